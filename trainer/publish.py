"""Weight publication: each stage's compressed update, and the signed manifest over them.

After each optimizer step every pipeline stage turns its weights into one blob
(``verify.weights_codec`` state delta) and puts it in a blob store; rank 0
collects every stage's (digest, size, kind) and signs a ``PolicyManifest``.
Contributors and validators rebuild the policy from the chain of blobs
(``rollout.sync``).

Invariants:
- A :class:`StagePublisher` holds the *published copy*: float32 weights equal,
  bit for bit, to what every contributor rebuilds. It advances that copy only
  by decoding its own blob with ``apply_state_delta``, the function
  contributors use, so the two can never drift apart.
- Error feedback. By default (``train_on="master"``) the trainer keeps
  optimizing its own float32 weights and every update sends
  ``current - published``: whatever a lossy codec dropped last time is still in
  that difference and goes out next time, so the residual is exactly
  ``current - published`` and no separate residual buffer is kept (one would
  count the dropped part twice). With ``train_on="published"`` the trainer
  loads the published copy into its module after each update
  (:meth:`StagePublisher.load_into`) and trains on what contributors hold;
  then ``current - published`` is one step's update only, and an explicit
  ``ErrorFeedback`` carries what the codec dropped into later updates.
- Every ``snapshot_every``-th version (0: never) is a full snapshot: the whole
  stage as ``fp32``, kind ``"full"``; it resets the residual and bounds the
  chain a newcomer has to replay.
- The tied embedding copy a last stage holds (``Stage.tied_copies``) is not
  published: stage 0 publishes the embedding and Hugging Face ties
  ``lm_head`` to it. The last stage still tracks that copy (``mirrors``) with
  the same codec on the same values, so it stays equal to stage 0's copy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from ledger.blobs import FileBlobStore, write_atomically
from verify.errors import ConfigError, Reason, VerificationError
from verify.keys import SigningKey
from verify.manifest import blob_digest, check_manifest, manifest_digest
from verify.signed import seal
from verify.types import SCHEMA_VERSION, PolicyManifest, ShardEntry, SignedManifest, decode
from verify.weights_codec import (
    Codec,
    ErrorFeedback,
    Fp32,
    apply_state_delta,
    encode_state_delta,
    get_codec,
)

FULL_CODEC = "fp32"
TrainOn = Literal["master", "published"]


@dataclass(frozen=True)
class ShardInfo:
    """What rank 0 needs from a stage to sign the manifest (small; safe to gather)."""

    stage: int
    digest: bytes
    nbytes: int
    kind: str  # "delta" | "full"
    codec: str


@dataclass(frozen=True)
class StageUpdate:
    """One stage's published update. Invariant: ``digest == blob_digest(blob)``."""

    stage: int
    blob: bytes
    digest: bytes
    nbytes: int
    kind: str
    codec: str

    def info(self) -> ShardInfo:
        return ShardInfo(self.stage, self.digest, self.nbytes, self.kind, self.codec)


def _f32(t: Tensor) -> Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _advance(
    published: dict[str, Tensor], current: Mapping[str, Tensor], codec: Codec,
    feedback: ErrorFeedback | None, full: bool,
) -> tuple[bytes, dict[str, Tensor]]:
    """(blob, new published copy): encode, then apply exactly as a contributor would."""
    if full:
        blob = encode_state_delta({n: current[n] for n in published}, Fp32())
        zeros = {n: torch.zeros_like(t) for n, t in published.items()}
        return blob, apply_state_delta(zeros, blob)
    deltas = {n: _f32(current[n]) - published[n] for n in published}
    blob = encode_state_delta(deltas, codec, feedback)
    return blob, apply_state_delta(published, blob)


class StagePublisher:
    """Publishes one pipeline stage's weights, version after version. See module docstring.

    ``initial_state`` is the stage's weights at version 0 (the base model),
    keyed by Hugging Face parameter name. ``mirrors`` names parameters this
    stage tracks but does not publish (a last stage's tied ``lm_head.weight``).
    """

    def __init__(
        self,
        stage_index: int,
        initial_state: Mapping[str, Tensor],
        codec_name: str,
        codec_params: Mapping[str, object] | None = None,
        snapshot_every: int = 0,
        *,
        mirrors: Sequence[str] = (),
        train_on: TrainOn = "master",
    ) -> None:
        if stage_index < 0:
            raise ConfigError(f"stage_index must be >= 0, got {stage_index}")
        if snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0, got {snapshot_every}")
        if train_on not in ("master", "published"):
            raise ConfigError(f"train_on must be 'master' or 'published', got {train_on!r}")
        unknown = sorted(set(mirrors) - set(initial_state))
        if unknown:
            raise ConfigError(f"mirrored parameters not in the stage: {unknown}")
        if not set(initial_state) - set(mirrors):
            raise ConfigError("a stage must publish at least one parameter")
        self.stage_index = stage_index
        self.codec_name = codec_name
        self.codec = get_codec(codec_name, **dict(codec_params or {}))
        self.snapshot_every = snapshot_every
        self.train_on: TrainOn = train_on
        self.version = 0
        mirrored = set(mirrors)
        self._own = {n: _f32(t).clone() for n, t in initial_state.items() if n not in mirrored}
        self._mirror = {n: _f32(t).clone() for n, t in initial_state.items() if n in mirrored}
        explicit = train_on == "published"
        self._feedback = ErrorFeedback() if explicit else None
        self._mirror_feedback = ErrorFeedback() if explicit else None

    @classmethod
    def for_stage(
        cls, stage: nn.Module, stage_index: int, codec_name: str,
        codec_params: Mapping[str, object] | None = None, snapshot_every: int = 0,
        *, train_on: TrainOn = "master",
    ) -> StagePublisher:
        """A publisher for a ``trainer.stages.Stage`` (or a whole HF model when S = 1)."""
        return cls(stage_index, publishable_state(stage), codec_name, codec_params,
                   snapshot_every, mirrors=tuple(getattr(stage, "tied_copies", {})),
                   train_on=train_on)

    def next_kind(self) -> str:
        """Kind of the next update: "full" every ``snapshot_every`` versions."""
        nxt = self.version + 1
        return "full" if self.snapshot_every and nxt % self.snapshot_every == 0 else "delta"

    def update(self, current_state: Mapping[str, Tensor]) -> StageUpdate:
        """Encode version ``self.version + 1`` from ``current_state``; advance the copy.

        ``current_state`` must hold every parameter of the stage (extra names,
        such as the tied ``lm_head.weight`` of an S = 1 model, are ignored), all
        finite; otherwise ValueError and nothing changes.
        """
        names = set(self._own) | set(self._mirror)
        missing = sorted(names - set(current_state))
        if missing:
            raise ValueError(f"current state lacks {missing[:5]}")
        copy = self.published_state()
        for name in names:
            t = current_state[name]
            if tuple(t.shape) != tuple(copy[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} differs from the published copy")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: weights are not finite")
        kind = self.next_kind()
        full = kind == "full"
        if full:
            for fb in (self._feedback, self._mirror_feedback):
                if fb is not None:
                    fb.reset()
        blob, self._own = _advance(self._own, current_state, self.codec, self._feedback, full)
        if self._mirror:
            _, self._mirror = _advance(
                self._mirror, current_state, self.codec, self._mirror_feedback, full
            )
        self.version += 1
        codec = FULL_CODEC if full else self.codec_name
        return StageUpdate(self.stage_index, blob, blob_digest(blob), len(blob), kind, codec)

    def published_state(self) -> dict[str, Tensor]:
        """The published copy (float32, CPU), mirrors included. Do not modify in place."""
        return {**self._own, **self._mirror}

    @torch.no_grad()
    def load_into(self, module: nn.Module) -> None:
        """Copy the published weights into ``module`` (same names), keeping its dtype/device.

        For ``train_on="published"``: call after every :meth:`update` so the
        trainer optimizes exactly what contributors hold.
        """
        state = self.published_state()
        params = dict(module.named_parameters(remove_duplicate=False))
        missing = sorted(set(state) - set(params))
        if missing:
            raise ValueError(f"module lacks published parameters {missing[:5]}")
        for name, value in state.items():
            params[name].copy_(value)


    def state(self) -> dict:
        """Checkpoint: version, published copy and residuals (restore with load_state)."""
        fbs = {"own": self._feedback, "mirror": self._mirror_feedback}
        return {
            "version": self.version, "own": dict(self._own), "mirror": dict(self._mirror),
            "residual": {k: _residuals(fb) for k, fb in fbs.items() if fb is not None},
        }

    def load_state(self, state: Mapping) -> None:
        if set(state["own"]) != set(self._own) or set(state["mirror"]) != set(self._mirror):
            raise ConfigError("checkpointed publisher holds other parameters")
        self.version = int(state["version"])
        self._own = {n: _f32(t).clone() for n, t in state["own"].items()}
        self._mirror = {n: _f32(t).clone() for n, t in state["mirror"].items()}
        for key, fb in (("own", self._feedback), ("mirror", self._mirror_feedback)):
            if fb is not None:
                fb.reset()
                fb._residual.update(state["residual"].get(key, {}))  # noqa: SLF001


def _residuals(fb: ErrorFeedback) -> dict[str, Tensor]:
    return dict(fb._residual)  # noqa: SLF001


def publishable_state(module: nn.Module) -> dict[str, Tensor]:
    """A stage's (or S = 1 model's) parameters by name; a tensor tied twice appears once."""
    return {name: p.detach() for name, p in module.named_parameters()}


def build_manifest(
    version: int,
    parent: SignedManifest | None,
    base_digest: bytes,
    updates: Sequence[StageUpdate | ShardInfo],
    codec_name: str,
    trainer_key: SigningKey,
    now_ms: int,
) -> SignedManifest:
    """Sign the manifest of ``version`` over every stage's update (stages 0..S-1 in order).

    ``parent`` is the manifest of ``version - 1`` (None for version 1, which
    applies to the base). Delta shards must use ``codec_name``; full shards ``fp32``.
    """
    if parent is None:
        if version != 1:
            raise ConfigError(f"only version 1 has no parent, got version {version}")
        parent_digest = b""
    else:
        prev = check_manifest(parent, trainer_key.public)
        if prev.version + 1 != version:
            raise ConfigError(f"version {version} does not follow parent {prev.version}")
        parent_digest = manifest_digest(parent)
    infos = sorted((u.info() if isinstance(u, StageUpdate) else u for u in updates),
                   key=lambda i: i.stage)
    if [i.stage for i in infos] != list(range(len(infos))) or not infos:
        raise ConfigError(f"updates must cover stages 0..S-1 once, got {[i.stage for i in infos]}")
    for i in infos:
        want = FULL_CODEC if i.kind == "full" else codec_name
        if i.codec != want:
            raise ConfigError(f"stage {i.stage}: {i.kind} update uses codec {i.codec!r}")
    shards = [ShardEntry(i.stage, i.digest, i.codec, i.nbytes, i.kind) for i in infos]
    manifest = PolicyManifest(SCHEMA_VERSION, version, parent_digest, base_digest, shards,
                              trainer_key.public.raw, now_ms)
    sealed = seal(trainer_key, manifest)
    assert isinstance(sealed, SignedManifest)
    return sealed


class PolicySink(Protocol):
    """Where the trainer publishes: blobs first, then the signed manifest naming them.

    :class:`LocalPolicyStore` is one; ``node.client``'s validator client (``put_blob``,
    ``publish``) is another.
    """

    def put_blob(self, data: bytes) -> bytes:
        """Store ``data``; returns its digest (``verify.manifest.blob_digest``)."""
        ...

    def publish(self, sealed: SignedManifest) -> object:
        """Record the manifest (a validator also appends ``policy_published`` to its ledger)."""
        ...


class LocalPolicyStore:
    """A directory: ``blobs/`` (a ``FileBlobStore``) and ``manifests/<version>.bin``.

    A manifest file is ``signature (64 bytes) || canonical manifest bytes``,
    written to a temp file and renamed. Publishing a different manifest for a
    version already published is refused (the trainer never equivocates).
    Reads hand back untrusted bytes; ``rollout.sync`` verifies them.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.blobs = FileBlobStore(self.root / "blobs")
        self._manifests = self.root / "manifests"

    def put_blob(self, data: bytes) -> bytes:
        return self.blobs.put(data)

    def blob(self, digest: bytes) -> bytes:
        return self.blobs.get(digest)

    def _path(self, version: int) -> Path:
        return self._manifests / f"{version:012d}.bin"

    def publish(self, sealed: SignedManifest) -> None:
        version = decode(PolicyManifest, sealed.manifest, max_bytes=len(sealed.manifest)).version
        data = bytes(sealed.signature) + bytes(sealed.manifest)
        target = self._path(version)
        if target.exists():
            if target.read_bytes() != data:
                raise VerificationError(f"version {version} is already published differently",
                                        reason=Reason.WRONG_MANIFEST)
            return
        write_atomically(target, data)

    def manifest(self, version: int) -> SignedManifest:
        try:
            data = self._path(version).read_bytes()
        except FileNotFoundError:
            raise VerificationError(f"no manifest for version {version}",
                                    reason=Reason.NOT_FOUND) from None
        return SignedManifest(manifest=data[64:], signature=data[:64])

    def latest(self) -> int:
        """Highest published version (0 when none)."""
        if not self._manifests.is_dir():
            return 0
        versions = [int(p.stem) for p in self._manifests.glob("*.bin") if p.stem.isdigit()]
        return max(versions, default=0)


def publish_version(
    publishers: Sequence[StagePublisher],
    states: Sequence[Mapping[str, Tensor]],
    sink: PolicySink,
    *,
    parent: SignedManifest | None,
    base_digest: bytes,
    trainer_key: SigningKey,
    now_ms: int,
) -> SignedManifest:
    """Single-process publication of every stage (S = 1, or all stages in one process).

    Blobs go to the sink before the manifest that names them. A pipeline job
    runs :meth:`StagePublisher.update` + ``put_blob`` on each rank, gathers the
    :class:`ShardInfo` on rank 0 and calls :func:`build_manifest` there.
    """
    if len(publishers) != len(states):
        raise ConfigError("one current state per publisher")
    codecs = {p.codec_name for p in publishers}
    if len(codecs) != 1:
        raise ConfigError(f"every stage must use the same codec, got {sorted(codecs)}")
    updates = [p.update(s) for p, s in zip(publishers, states, strict=True)]
    for u in updates:
        if sink.put_blob(u.blob) != u.digest:
            raise VerificationError("sink stored the blob under another digest",
                                    reason=Reason.DIGEST_MISMATCH)
    version = publishers[0].version
    sealed = build_manifest(version, parent, base_digest, updates, codecs.pop(), trainer_key,
                            now_ms)
    sink.publish(sealed)
    return sealed


Gather = Callable[[ShardInfo], "list[ShardInfo] | None"]
"""This rank's shard info -> every stage's on rank 0, None elsewhere."""


def gather_single(info: ShardInfo) -> list[ShardInfo]:
    return [info]


def gather_distributed(info: ShardInfo) -> list[ShardInfo] | None:
    """``torch.distributed.gather_object`` to rank 0 over the default group (one rank per stage)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: list | None = [None] * world if rank == 0 else None
    dist.gather_object(info, out, dst=0)
    return out


class PublishHook:
    """``trainer.loop``'s ``publish(version, stage)`` hook: one pipeline rank's publication.

    Every rank encodes its stage and puts its blob in ``sink``; ``gather``
    brings every stage's :class:`ShardInfo` to rank 0, which signs the manifest
    (``trainer_key`` is needed there only) and publishes it. With
    ``train_on="published"`` the stage then continues from the published weights.
    ``state``/``load_state`` go into the loop's checkpoint, so a resumed run
    keeps the copy contributors hold.
    """

    def __init__(
        self, publisher: StagePublisher, sink: PolicySink, *, base_digest: bytes,
        trainer_key: SigningKey | None, gather: Gather = gather_single,
        now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.publisher, self.sink, self.base_digest = publisher, sink, base_digest
        self.trainer_key, self.gather, self.now_ms = trainer_key, gather, now_ms
        self.parent: SignedManifest | None = None

    def __call__(self, version: int, stage: nn.Module) -> SignedManifest | None:
        if self.publisher.version + 1 != version:
            raise ConfigError(f"publisher is at version {self.publisher.version}; "
                              f"cannot publish {version}")
        update = self.publisher.update(publishable_state(stage))
        if self.sink.put_blob(update.blob) != update.digest:
            raise VerificationError("sink stored the blob under another digest",
                                    reason=Reason.DIGEST_MISMATCH)
        infos = self.gather(update.info())
        sealed = None
        if infos is not None:
            if self.trainer_key is None:
                raise ConfigError("the rank that signs manifests needs the trainer key")
            sealed = build_manifest(version, self.parent, self.base_digest, infos,
                                    self.publisher.codec_name, self.trainer_key, self.now_ms())
            self.sink.publish(sealed)
            self.parent = sealed
        if self.publisher.train_on == "published":
            self.publisher.load_into(stage)
        return sealed

    def state(self) -> dict:
        parent = None if self.parent is None else (self.parent.manifest, self.parent.signature)
        return {"publisher": self.publisher.state(), "parent": parent}

    def load_state(self, state: Mapping) -> None:
        self.publisher.load_state(state["publisher"])
        parent = state["parent"]
        self.parent = None if parent is None else SignedManifest(manifest=parent[0],
                                                                 signature=parent[1])
