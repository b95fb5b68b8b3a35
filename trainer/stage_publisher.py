"""One pipeline stage's published copy and the compressed update that advances it.

After each optimizer step a stage turns its weights into one blob
(``verify.weights_codec`` state delta); ``trainer.publish`` stores the blobs
and signs the manifest naming them. Contributors and validators rebuild the
policy from the chain of blobs (``rollout.sync``).

Invariants:
- A :class:`StagePublisher` holds the *published copy*: float32 weights equal,
  bit for bit, to what every contributor rebuilds. It advances that copy by
  the values its own blob decodes to: decoded with ``add_state_delta_``, the
  function contributors use, or (``Int8Block``) by the same IEEE float32
  products and additions from the encoder's own quantised values
  (``encode_state_delta_applied_``), which the tests check bit for bit against
  a contributor's rebuild.
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
- :meth:`StagePublisher.update` advances the copy by exactly one version; given
  missing, misshapen or non-finite weights it raises ValueError and changes
  nothing. ``StageUpdate.digest == blob_digest(StageUpdate.blob)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from verify.aggregate_blocks import all_finite
from verify.errors import ConfigError
from verify.manifest import blob_digest
from verify.weights_codec import (
    Codec,
    ErrorFeedback,
    Fp32,
    add_state_delta_,
    apply_state_delta,
    encode_state_delta,
    encode_state_delta_applied_,
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
    published: dict[str, Tensor],
    current: Mapping[str, Tensor],
    codec: Codec,
    feedback: ErrorFeedback | None,
    full: bool,
    scratch: dict[str, Tensor],
) -> tuple[bytes, dict[str, Tensor]]:
    """(blob, new published copy): encode, then apply exactly as a contributor would.

    Without explicit error feedback the deltas are formed in ``scratch`` (buffers kept
    from version to version, so a step does not page in a fresh stage-sized allocation)
    and the copy advances by the values the codec decodes from its own bytes
    (``encode_state_delta_applied_``: bit for bit what ``add_state_delta_`` adds)."""
    if full:
        blob = encode_state_delta({n: current[n] for n in published}, Fp32())
        zeros = {n: torch.zeros_like(t) for n, t in published.items()}
        return blob, apply_state_delta(zeros, blob)
    if feedback is not None:
        deltas = {n: _f32(current[n]) - published[n] for n in published}
        blob = encode_state_delta(deltas, codec, feedback)
        del deltas
        add_state_delta_(published, blob)  # in place: no second copy of the stage per version
        return blob, published
    for n, w in published.items():
        buf = scratch.get(n)
        if buf is None or buf.shape != w.shape:
            buf = scratch[n] = torch.empty_like(w)
        torch.sub(_f32(current[n]), w, out=buf)
    return encode_state_delta_applied_(
        published, {n: scratch[n] for n in published}, codec
    ), published


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
        self._scratch: dict[str, Tensor] = {}  # the deltas' buffers (``_advance``)

    @classmethod
    def for_stage(
        cls,
        stage: nn.Module,
        stage_index: int,
        codec_name: str,
        codec_params: Mapping[str, object] | None = None,
        snapshot_every: int = 0,
        *,
        train_on: TrainOn = "master",
    ) -> StagePublisher:
        """A publisher for a ``trainer.stages.Stage`` (or a whole HF model when S = 1)."""
        return cls(
            stage_index,
            publishable_state(stage),
            codec_name,
            codec_params,
            snapshot_every,
            mirrors=tuple(getattr(stage, "tied_copies", {})),
            train_on=train_on,
        )

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
            if not all_finite(t):
                raise ValueError(f"{name}: weights are not finite")
        kind = self.next_kind()
        full = kind == "full"
        if full:
            for fb in (self._feedback, self._mirror_feedback):
                if fb is not None:
                    fb.reset()
        blob, self._own = _advance(
            self._own, current_state, self.codec, self._feedback, full, self._scratch
        )
        if self._mirror:
            _, self._mirror = _advance(
                self._mirror, current_state, self.codec, self._mirror_feedback, full, self._scratch
            )
        self.version += 1
        codec = FULL_CODEC if full else self.codec_name
        return StageUpdate(self.stage_index, blob, blob_digest(blob), len(blob), kind, codec)

    def published_state(self) -> dict[str, Tensor]:
        """The published copy (float32, CPU), mirrors included. Do not modify in place;
        :meth:`update` advances these tensors in place (copy what must outlive it)."""
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
            "version": self.version,
            "own": dict(self._own),
            "mirror": dict(self._mirror),
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
