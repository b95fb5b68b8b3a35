"""Offline replay of a published delta chain, for release verification.

Independent of the contributor path (``rollout.sync.PolicySync``, which
needs ``transformers`` and the pipeline partition): each blob names its own
parameters (``verify.weights_codec`` state deltas), so the replay applies
every stage's blob to the parameters it names, and checks that the stages of
one version name every parameter exactly once. Both paths apply the same
exactly-rounded float32 operations, so they agree bit for bit; a release's
``weights_digest`` is checked against this replay.

Inputs are untrusted: every manifest has already been checked
(``verify.manifest.check_chain``) and every blob is checked against its
manifest entry (``check_blob``) before it is decoded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from verify.errors import Reason, VerificationError
from verify.hashing import RELEASE_WEIGHTS, blake3_digest
from verify.manifest import check_blob
from verify.types import PolicyManifest
from verify.weights_codec import DEFAULT_LIMITS, DecodeLimits, apply_delta, split_state_delta

State = dict[str, Tensor]


def tensor_digest(state: Mapping[str, Tensor]) -> bytes:
    """Digest of weights by content: per name (sorted) its dtype, shape and little-endian bytes.

    Layout per tensor: ``u32 len(name) | name | u32 len(dtype) | dtype | u32 ndim | u64 dims
    | u64 nbytes | raw bytes``. Independent of how a file orders or aligns them.
    """
    parts: list[bytes] = []
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).encode()
        parts += [
            len(name.encode()).to_bytes(4, "little"),
            name.encode(),
            len(dtype).to_bytes(4, "little"),
            dtype,
            t.dim().to_bytes(4, "little"),
            *(int(d).to_bytes(8, "little") for d in t.shape),
            len(raw).to_bytes(8, "little"),
            raw,
        ]
    return blake3_digest(RELEASE_WEIGHTS, *parts)


def load_state(path: str | os.PathLike) -> State:
    """Float32 tensors of one safetensors file."""
    from safetensors.torch import load_file

    return {n: t.to(torch.float32) for n, t in load_file(str(path)).items()}


def chain_start(manifests: Sequence[PolicyManifest]) -> int:
    """Index in ``manifests`` (versions 1..V) of the latest full snapshot, else 0."""
    start = 0
    for i, m in enumerate(manifests):
        if all(s.kind == "full" for s in m.shards):
            start = i
    return start


def replay(
    base: Mapping[str, Tensor],
    manifests: Sequence[PolicyManifest],
    fetch_blob: Callable[[bytes], bytes],
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> State:
    """Weights after applying ``manifests`` (a checked chain, versions 1..V) to ``base``.

    Starts at the latest full snapshot (earlier blobs are never fetched).
    Raises VerificationError (DIGEST_MISMATCH / INCONSISTENT) or DecodeError.
    """
    state: State = dict(base)
    for manifest in manifests[chain_start(manifests) :]:
        state = apply_version(state, manifest, fetch_blob, limits)
    return state


def apply_version(
    state: State,
    manifest: PolicyManifest,
    fetch_blob: Callable[[bytes], bytes],
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> State:
    """``state`` after one version's shards (each blob checked against ``manifest`` first)."""
    out: State = {}
    for shard in manifest.shards:
        blob = fetch_blob(shard.digest)
        check_blob(manifest, shard.stage, blob)
        for name, part in split_state_delta(blob, limits):
            if name not in state:
                raise VerificationError(
                    f"version {manifest.version} stage {shard.stage} updates an unknown parameter",
                    reason=Reason.INCONSISTENT,
                    computed=name,
                )
            if name in out:
                raise VerificationError(
                    f"version {manifest.version} updates a parameter twice",
                    reason=Reason.INCONSISTENT,
                    computed=name,
                )
            prev = torch.zeros_like(state[name]) if shard.kind == "full" else state[name]
            out[name] = apply_delta(prev, part, limits)
    missing = sorted(set(state) - set(out))
    if missing:
        raise VerificationError(
            f"version {manifest.version} leaves parameters out",
            reason=Reason.INCONSISTENT,
            computed=missing[:5],
        )
    return out
