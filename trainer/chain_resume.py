"""Rebuild the trainer's published copy from the chain of signed updates a validator holds.

A trainer without a checkpoint of its run can still continue it: the chain of
trainer-signed manifests 1..V and their update blobs fixes the policy at
version V exactly. The chain is checked as ``prooftrain release verify``
checks a release, with the same functions, before anything is decoded:

1. every manifest verifies under the trainer key, names the version it was
   fetched for, and the chain links from version 1 (empty parent) to V
   (``verify.manifest.check_chain``);
2. version 1 names this base model (later ones must keep it: step 1);
3. from the latest full snapshot on, each blob has the size and digest its
   manifest names (``verify.manifest.check_blob``) and names every parameter
   once (``ledger.release_replay.apply_version``).

The blobs are applied with the exactly rounded float32 operations contributors
use, so the rebuilt weights equal, bit for bit, the published copy that every
contributor and the validator hold, and the trainer's own
``StagePublisher`` copy at V.

What the chain does not hold: the optimizer's moments, the error-feedback
residual (the trainer's float32 master weights minus the published copy), the
RNG state, and the samples the stopped trainer had fetched but not trained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

from ledger.release_replay import apply_version, chain_start
from verify.errors import ProofTrainError, Reason, VerificationError
from verify.keys import PublicKey
from verify.manifest import check_chain
from verify.types import SignedManifest

State = dict[str, Tensor]


class ChainError(ProofTrainError):
    """The validator's chain cannot be rebuilt; ``version`` is where it failed and
    ``cause`` the verification error (with its reason code)."""

    def __init__(self, version: int, cause: ProofTrainError) -> None:
        super().__init__(f"policy version {version}: {cause}")
        self.version, self.cause = version, cause


def rebuild_published(
    version: int,
    base: Mapping[str, Tensor],
    *,
    base_digest: bytes,
    trainer: PublicKey,
    fetch_manifest: Callable[[int], SignedManifest],
    fetch_blob: Callable[[bytes], bytes],
) -> tuple[State, SignedManifest]:
    """(weights of ``version``, its sealed manifest), from ``base`` (version 0, float32, one
    entry per published parameter) and the chain ``fetch_manifest``/``fetch_blob`` serve.

    Raises :class:`ChainError` naming the first version that fails a check.
    """
    if version < 1:
        raise ValueError(f"version must be >= 1, got {version}")
    sealed: list[SignedManifest] = []
    for v in range(1, version + 1):
        try:
            sealed.append(fetch_manifest(v))
        except ProofTrainError as exc:
            raise ChainError(v, exc) from exc
    try:
        manifests = check_chain(sealed, trainer)  # step 1
    except ProofTrainError as exc:
        raise ChainError(_failed_at(sealed, trainer), exc) from exc
    for v, m in enumerate(manifests, start=1):
        if m.version != v or (v == 1 and m.parent_digest):
            raise ChainError(
                v,
                VerificationError(
                    "fetched manifest is not this version of the chain",
                    reason=Reason.WRONG_MANIFEST,
                    expected=v,
                    computed=m.version,
                ),
            )
    if manifests[0].base_digest != base_digest:  # step 2
        raise ChainError(
            1,
            VerificationError(
                "manifest is for another base model",
                reason=Reason.WRONG_MANIFEST,
                expected=base_digest,
                computed=manifests[0].base_digest,
            ),
        )
    state: State = dict(base)
    for manifest in manifests[chain_start(manifests) :]:  # step 3
        try:
            state = apply_version(state, manifest, fetch_blob)
        except ProofTrainError as exc:
            raise ChainError(manifest.version, exc) from exc
    return state, sealed[-1]


def _failed_at(sealed: list[SignedManifest], trainer: PublicKey) -> int:
    """The first version whose prefix of the chain fails ``check_chain`` (a prefix of a
    passing prefix passes, so bisect)."""
    lo, hi = 1, len(sealed)  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            check_chain(sealed[:mid], trainer)
            lo = mid + 1
        except ProofTrainError:
            hi = mid
    return lo
