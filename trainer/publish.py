"""Weight publication: each stage's compressed update, and the signed manifest over them.

After each optimizer step every pipeline stage turns its weights into one blob
(:class:`trainer.stage_publisher.StagePublisher`) and puts it in a blob store
(a :class:`trainer.policy_store.PolicySink`); rank 0 collects every stage's
(digest, size, kind) and signs a ``PolicyManifest``. Contributors and
validators rebuild the policy from the chain of blobs (``rollout.sync``).

Invariants:
- Blobs reach the sink before the manifest that names them, and a sink that
  stores a blob under another digest is refused (``digest_mismatch``).
- Version v's manifest names version v - 1's manifest as its parent (version
  1 has none and applies to the base), covers stages 0..S-1 exactly once, and
  its delta shards all use one codec while full shards use ``fp32``.
- Only the rank that signs needs the trainer key.

The stage publisher (``StagePublisher``, ``ShardInfo``, ``StageUpdate``,
``publishable_state``) and the sinks (``PolicySink``, ``LocalPolicyStore``)
are importable from here as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from torch import Tensor, nn

from trainer.policy_store import LocalPolicyStore, PolicySink
from trainer.stage_publisher import (
    FULL_CODEC,
    ShardInfo,
    StagePublisher,
    StageUpdate,
    TrainOn,
    publishable_state,
)
from verify.errors import ConfigError, Reason, VerificationError
from verify.keys import SigningKey
from verify.manifest import check_manifest, manifest_digest
from verify.signed import seal
from verify.types import SCHEMA_VERSION, PolicyManifest, ShardEntry, SignedManifest

__all__ = [
    "FULL_CODEC",
    "Gather",
    "LocalPolicyStore",
    "PolicySink",
    "PublishHook",
    "ShardInfo",
    "StagePublisher",
    "StageUpdate",
    "TrainOn",
    "build_manifest",
    "gather_distributed",
    "gather_single",
    "publish_version",
    "publishable_state",
]


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
    infos = sorted(
        (u.info() if isinstance(u, StageUpdate) else u for u in updates), key=lambda i: i.stage
    )
    if [i.stage for i in infos] != list(range(len(infos))) or not infos:
        raise ConfigError(f"updates must cover stages 0..S-1 once, got {[i.stage for i in infos]}")
    for i in infos:
        want = FULL_CODEC if i.kind == "full" else codec_name
        if i.codec != want:
            raise ConfigError(f"stage {i.stage}: {i.kind} update uses codec {i.codec!r}")
    shards = [ShardEntry(i.stage, i.digest, i.codec, i.nbytes, i.kind) for i in infos]
    manifest = PolicyManifest(
        SCHEMA_VERSION, version, parent_digest, base_digest, shards, trainer_key.public.raw, now_ms
    )
    sealed = seal(trainer_key, manifest)
    return sealed


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
            raise VerificationError(
                "sink stored the blob under another digest", reason=Reason.DIGEST_MISMATCH
            )
    version = publishers[0].version
    sealed = build_manifest(
        version, parent, base_digest, updates, codecs.pop(), trainer_key, now_ms
    )
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
        self,
        publisher: StagePublisher,
        sink: PolicySink,
        *,
        base_digest: bytes,
        trainer_key: SigningKey | None,
        gather: Gather = gather_single,
        now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.publisher, self.sink, self.base_digest = publisher, sink, base_digest
        self.trainer_key, self.gather, self.now_ms = trainer_key, gather, now_ms
        self.parent: SignedManifest | None = None

    def __call__(self, version: int, stage: nn.Module) -> SignedManifest | None:
        if self.publisher.version + 1 != version:
            raise ConfigError(
                f"publisher is at version {self.publisher.version}; cannot publish {version}"
            )
        update = self.publisher.update(publishable_state(stage))
        if self.sink.put_blob(update.blob) != update.digest:
            raise VerificationError(
                "sink stored the blob under another digest", reason=Reason.DIGEST_MISMATCH
            )
        infos = self.gather(update.info())
        sealed = None
        if infos is not None:
            if self.trainer_key is None:
                raise ConfigError("the rank that signs manifests needs the trainer key")
            sealed = build_manifest(
                version,
                self.parent,
                self.base_digest,
                infos,
                self.publisher.codec_name,
                self.trainer_key,
                self.now_ms(),
            )
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
        self.parent = (
            None if parent is None else SignedManifest(manifest=parent[0], signature=parent[1])
        )
