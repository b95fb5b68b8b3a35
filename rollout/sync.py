"""Rebuild a published policy version from the base model and the trainer's signed updates.

Version 0 is the base model directory. Version v is the base, then the chain
of manifests back to version 1 or to the latest full snapshot, each stage's
blob applied in order with ``verify.weights_codec.apply_state_delta`` (a
``"full"`` shard is applied to zeros, which gives the snapshot exactly). The
trainer advances its own published copy with the same function, so both
sides hold bit-identical float32 weights.

Threat model: manifests and blobs come from an untrusted transport. Before
anything is decoded, in order:

1. every manifest of the chain verifies under the trainer key and names the
   version it was fetched for (``check_manifest``);
2. the chain links (``check_chain``: consecutive versions, parent digests,
   same base, starting at version 1 or at a full snapshot);
3. every manifest names this base model (``base_model_digest``) and has
   ``num_stages`` shards;
4. every blob to apply has the size and digest its manifest names (``check_blob``).

Only then are blobs decoded, each against ``DecodeLimits``.

Parameter names: a pipeline stage's parameters carry their Hugging Face names
(``trainer.stages``), so a stage's state is a slice of the full model's.
:func:`stage_of` is the one place that says which stage publishes a name.
A tied ``lm_head.weight`` is not a separate parameter: it follows
``model.embed_tokens.weight`` (published by stage 0).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from rollout.loading import load_pretrained_lm
from verify.errors import ConfigError, Reason, VerificationError
from verify.keys import PublicKey
from verify.manifest import (
    base_model_digest,
    check_blob,
    check_chain,
    check_manifest,
    manifest_digest,
)
from verify.types import PolicyManifest, SignedManifest
from verify.weights_codec import DEFAULT_LIMITS, DecodeLimits, apply_state_delta

State = dict[str, Tensor]
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model one pipeline stage owns.

    ``layers`` is a contiguous range of global decoder-block indices.
    """

    index: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def partition_layers(num_layers: int, num_stages: int) -> tuple[StageSpec, ...]:
    """Split ``num_layers`` blocks into ``num_stages`` contiguous, balanced groups.

    Earlier stages get the extra block when the split is uneven. Every stage gets
    at least one block. The one partition: the trainer's stages (``trainer.stages``)
    and the stage that publishes each parameter (:func:`stage_of`) both read it.
    """
    if num_stages < 1:
        raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ConfigError(f"cannot split {num_layers} decoder layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    specs, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        specs.append(StageSpec(index=s, num_stages=num_stages, layers=range(start, start + n)))
        start += n
    return tuple(specs)


def layer_stages(num_layers: int, num_stages: int) -> list[int]:
    """Stage of each decoder layer, by :func:`partition_layers`."""
    return [spec.index for spec in partition_layers(num_layers, num_stages) for _ in spec.layers]


def stage_of(name: str, layers: list[int]) -> int:
    """The stage that publishes full-model parameter ``name`` (``layers`` from layer_stages)."""
    if name.startswith("model.embed_tokens."):
        return 0
    match = _LAYER.match(name)
    if match:
        return layers[int(match.group(1))]
    if name.startswith(("model.norm.", "lm_head.")):
        return max(layers)
    raise ConfigError(f"parameter {name!r} belongs to no pipeline stage")


def stage_names(model: nn.Module, num_stages: int) -> list[list[str]]:
    """Parameter names each stage publishes, for a Hugging Face causal LM."""
    config = cast(Any, model).config  # a transformers PretrainedConfig
    layers = layer_stages(int(config.num_hidden_layers), num_stages)
    out: list[list[str]] = [[] for _ in range(num_stages)]
    for name, _ in model.named_parameters():
        out[stage_of(name, layers)].append(name)
    return out


class PolicySync:
    """Verified reconstruction of policy versions (see module docstring).

    ``fetch_manifest(version)`` and ``fetch_blob(digest)`` are the transport
    (HTTP, a local store); their output is untrusted. The last ``max_cached``
    rebuilt versions are kept, so following the trainer one version at a time
    decodes one update per stage per version. Not thread-safe.
    """

    def __init__(
        self,
        base_model_dir: str | os.PathLike,
        trainer_pub: PublicKey,
        fetch_manifest: Callable[[int], SignedManifest],
        fetch_blob: Callable[[bytes], bytes],
        num_stages: int,
        *,
        max_cached: int = 2,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        if max_cached < 1:
            raise ConfigError("max_cached must be >= 1")
        self.trainer = trainer_pub
        self.num_stages = num_stages
        self.limits = limits
        self.max_cached = max_cached
        self._fetch_manifest = fetch_manifest
        self._fetch_blob = fetch_blob
        self.base_digest = base_model_digest(base_model_dir)
        self._template = load_pretrained_lm(base_model_dir, dtype=torch.float32).eval()
        self._stages = stage_names(self._template, num_stages)
        # The template is never modified (model_at copies it), so version 0 shares its storage.
        self._base: State = {n: p.detach() for n, p in self._template.named_parameters()}
        self._cache: OrderedDict[int, tuple[bytes, State]] = OrderedDict()
        self._manifests: OrderedDict[int, tuple[SignedManifest, PolicyManifest]] = OrderedDict()

    # -- public
    def state_at(self, version: int) -> State:
        """Full-model float32 state (one entry per distinct parameter) of ``version``.

        Tensors may be shared with the cache: do not modify them in place.
        Raises VerificationError / DecodeError (with a ``Reason``) on any failed check.
        """
        if version < 0:
            raise ConfigError(f"version must be >= 0, got {version}")
        if version == 0:
            return dict(self._base)
        if version in self._cache:
            self._cache.move_to_end(version)
            return dict(self._cache[version][1])
        anchor, todo = self._verified_chain(version)  # steps 1-3
        state = self._base if anchor is None else self._cache[anchor][1]
        blobs = [[self._blob(m, s) for s in range(self.num_stages)] for _, m in todo]  # step 4
        for (_, manifest), stage_blobs in zip(todo, blobs, strict=True):
            state = self._apply(state, manifest, stage_blobs)
        self._remember(version, manifest_digest(todo[-1][0]), state)
        return dict(state)

    def model_at(self, version: int) -> nn.Module:
        """A fresh ``transformers`` model (float32, CPU, eval) holding ``version``'s weights."""
        state = self.state_at(version)
        model = copy.deepcopy(self._template)
        with torch.no_grad():
            params = dict(model.named_parameters())
            if set(params) != set(state):
                raise ConfigError("rebuilt state does not match the model's parameters")
            for name, p in params.items():
                p.copy_(state[name])
        return model

    def stage_state(self, version: int, stage: int) -> State:
        """The slice of ``state_at(version)`` that pipeline stage ``stage`` publishes."""
        state = self.state_at(version)
        return {n: state[n] for n in self._stages[stage]}

    # -- verification
    def _manifest(self, version: int) -> tuple[SignedManifest, PolicyManifest]:
        hit = self._manifests.get(version)
        if hit is not None:
            self._manifests.move_to_end(version)
            return hit
        sealed = self._fetch_manifest(version)
        manifest = check_manifest(sealed, self.trainer)  # step 1
        if manifest.version != version:
            raise VerificationError(
                "fetched manifest is for another version",
                reason=Reason.WRONG_MANIFEST,
                expected=version,
                computed=manifest.version,
            )
        self._manifests[version] = (sealed, manifest)
        while len(self._manifests) > 1024:
            self._manifests.popitem(last=False)
        return sealed, manifest

    def _verified_chain(
        self, version: int
    ) -> tuple[int | None, list[tuple[SignedManifest, PolicyManifest]]]:
        """(anchor, manifests to apply): walk back to a cached version or a chain start.

        An anchor is a version whose state is cached (its chain was verified
        when it was built); the manifests after it must link to it. Without
        one, the walk ends at version 1 or a full snapshot and ``check_chain``
        verifies the whole chain. Every manifest passed ``check_manifest``.
        """
        chain: list[tuple[SignedManifest, PolicyManifest]] = []
        v, anchor = version, None
        while True:
            sealed, manifest = self._manifest(v)
            chain.append((sealed, manifest))
            if v == 1 or all(s.kind == "full" for s in manifest.shards):
                break
            if v - 1 in self._cache:
                anchor = v - 1
                break
            v -= 1
        chain.reverse()
        if anchor is None:
            check_chain([sealed for sealed, _ in chain], self.trainer)  # step 2
        else:  # step 2 from a verified anchor: each manifest extends the previous one
            parent = self._cache[anchor][0]
            for sealed, manifest in chain:
                if manifest.parent_digest != parent:
                    raise VerificationError(
                        "manifest does not extend its parent",
                        reason=Reason.WRONG_MANIFEST,
                        expected=parent,
                        computed=manifest.parent_digest,
                    )
                parent = manifest_digest(sealed)
        for _, manifest in chain:  # step 3
            if manifest.base_digest != self.base_digest:
                raise VerificationError(
                    "manifest is for another base model",
                    reason=Reason.WRONG_MANIFEST,
                    expected=self.base_digest,
                    computed=manifest.base_digest,
                )
            if len(manifest.shards) != self.num_stages:
                raise VerificationError(
                    "manifest has another number of stages",
                    reason=Reason.INCONSISTENT,
                    expected=self.num_stages,
                    computed=len(manifest.shards),
                )
        return anchor, chain

    def _blob(self, manifest: PolicyManifest, stage: int) -> bytes:
        data = self._fetch_blob(manifest.shards[stage].digest)
        check_blob(manifest, stage, data)
        return data

    # -- decoding
    def _apply(
        self, state: Mapping[str, Tensor], manifest: PolicyManifest, blobs: list[bytes]
    ) -> State:
        out: State = {}
        for shard, blob in zip(manifest.shards, blobs, strict=True):
            names = self._stages[shard.stage]
            if shard.kind == "full":
                prev = {n: torch.zeros_like(state[n]) for n in names}
            else:
                prev = {n: state[n] for n in names}
            out.update(apply_state_delta(prev, blob, self.limits))
        return out

    def _remember(self, version: int, digest: bytes, state: State) -> None:
        self._cache[version] = (digest, state)
        self._cache.move_to_end(version)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)


_SKIP_BASE_FILES = {"build.json", "README.md", "model.safetensors.index.json"}


def write_model_dir(
    out: str | Path,
    base_model: str | Path,
    state: Mapping[str, Tensor],
    weights_file: str = "model.safetensors",
) -> None:
    """A loadable model directory: ``state`` (e.g. :meth:`PolicySync.state_at`) as one
    safetensors file beside the base model's other files (config, tokenizer), without the
    base's own weights, shard index and build notes."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in state.items()},
        str(out / weights_file),
        metadata={"format": "pt"},
    )
    for f in sorted(Path(base_model).iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIP_BASE_FILES:
            shutil.copyfile(f, out / f.name)
