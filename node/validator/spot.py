"""Spot checks: recompute an audited rollout and compare it with what was committed.

For an audited envelope the validator runs one teacher-forced forward pass of
the claimed policy version over prompt + completion, then, in order:

1. logprob comparison on every completion token, chunk by chunk
   (``verify.spotcheck.compare_chunk``; LOGPROB_MISMATCH);
2. on every token (``audit.chunks_per_audit = 0``, the default), or on k drawn
   chunks (keyed draw, ``verify.challenge.chunks_to_open``): the support check
   (TOKEN_OUTSIDE_SUPPORT) and the verifiable-sampler replay
   (SAMPLER_REPLAY_MISMATCH) of the sampler the assignment names
   (``verify.samplers``: one hash and a pass over the vocabulary per token for
   the inverse-CDF sampler, O(V) hash output for Gumbel-max);
3. randomised PIT values of every token, pooled per contributor by the caller
   for the sampling-distribution test.

A failure raises ``SpotCheckFailed`` carrying the recomputed logprobs, so the
caller can file :class:`verify.types.SlashEvidence` that
:func:`recheck_evidence` re-verifies offline with only the contributor's public
key, the validator's public key and the claimed policy's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verify.challenge import chunks_to_open
from verify.commitment import n_chunks
from verify.divergence import RolloutEvidence
from verify.envelope import Limits, VerifiedRollout, check_stopping_rule, verify_envelope
from verify.errors import Reason, SpotCheckError, VerificationError
from verify.keys import PublicKey
from verify.sampler_checks import ReplayStats
from verify.samplers import sampler_named
from verify.sampling import NoiseSpec, pit_randomizer, pit_values, process_logits, support_check
from verify.signed import open_sealed
from verify.spotcheck import (
    MIN_MEAN_TOKENS,
    DistributionOracle,
    Tolerance,
    Tolerances,
    compare_chunk,
    token_diffs,
)
from verify.types import SignedAssignment, SlashEvidence, WorkAssignment, canonical_bytes, decode

_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")


@dataclass(frozen=True)
class SpotCheckResult:
    chunks: list[int]
    recomputed: np.ndarray  # (T,) float32 processed logprobs of the completion tokens
    pit: np.ndarray  # (T,) float64 randomised PIT values
    max_abs_diff: float
    evidence: RolloutEvidence | None = None
    """What this rollout adds to its contributor's divergence detector at its declared
    precision (``verify.divergence``); None when that precision runs no sequential test."""


class SpotCheckFailed(SpotCheckError):
    """A spot check failed; carries what the validator recomputed."""

    def __init__(self, cause: SpotCheckError, chunks: list[int], recomputed: np.ndarray) -> None:
        super().__init__(
            str(cause).split("] ", 1)[-1],
            reason=cause.reason,
            expected=cause.expected,
            computed=cause.computed,
        )
        self.chunks = chunks
        self.recomputed = recomputed


def _check(
    rollout: VerifiedRollout,
    logits: np.ndarray,
    chunks: list[int],
    tolerance: Tolerance,
    processed: torch.Tensor | None = None,
) -> tuple[np.ndarray, float, np.ndarray]:
    """(recomputed logprobs, largest |diff|, replay gaps of the replayed tokens in order)."""
    h = rollout.header
    s = h.sampling
    tokens = rollout.token_ids.astype(np.int64)
    if processed is None:
        processed = process_logits(
            torch.from_numpy(logits), s.temperature, s.top_k, s.top_p
        )  # (T, V)
    recomputed = _token_logprobs(processed, rollout.token_ids)
    worst = 0.0
    for c in range(n_chunks(h.token_count, h.chunk_size)):
        lo, hi = c * h.chunk_size, min((c + 1) * h.chunk_size, h.token_count)
        stats = compare_chunk(
            rollout.logprobs[lo:hi], recomputed[lo:hi], tolerance, c, position_offset=lo
        )
        worst = max(worst, stats.max_abs_diff)
    vocab = logits.shape[-1]
    sampler = sampler_named(s.sampler)
    gaps: list[np.ndarray] = []
    for c in chunks:
        lo, hi = c * h.chunk_size, min((c + 1) * h.chunk_size, h.token_count)
        support_check(
            tokens[lo:hi], logits[lo:hi], s.temperature, s.top_k, s.top_p, position_offset=lo
        )
        randomness = sampler.randomness(
            [(h.contributor_key, h.nonce, s.seed, h.group_index, range(lo, hi))], vocab
        )
        replayed = sampler.replay(
            tokens[lo:hi],
            logits[lo:hi],
            s.temperature,
            s.top_k,
            s.top_p,
            randomness,
            slack=sampler.slack(tolerance),
            position_offset=lo,
            processed=processed[lo:hi],
        )
        gaps.append(_gaps(replayed))
    return recomputed, worst, np.concatenate(gaps) if gaps else np.zeros(0)


def _gaps(stats: ReplayStats) -> np.ndarray:
    """The replay gaps of a passing replay as float64 ``(n,)``; zeros for a sampler without
    calibrated gaps (its replay channel then scores nothing)."""
    if stats.gaps is None:
        return np.zeros(stats.tokens)
    return stats.gaps.detach().to("cpu", torch.float64).numpy()


def _evidence(
    r: VerifiedRollout, recomputed: np.ndarray, gaps: np.ndarray, tolerance: Tolerance
) -> RolloutEvidence | None:
    test = tolerance.divergence
    return None if test is None else test.evidence(r.logprobs, recomputed, gaps)


def spot_check(
    rollout: VerifiedRollout,
    prompt_ids: Sequence[int],
    oracle: DistributionOracle,
    secret: bytes,
    chunks_per_audit: int,
    tolerance: Tolerance | Tolerances,
) -> SpotCheckResult:
    """Run checks 1-3 on one rollout; raise :class:`SpotCheckFailed` on the first failure."""
    result = spot_check_group([rollout], prompt_ids, oracle, secret, chunks_per_audit, tolerance)[0]
    if isinstance(result, SpotCheckFailed):
        raise result
    return result


@dataclass(frozen=True)
class SpotJob:
    """The audited rollouts of one assignment: one prompt, version and sampling parameters."""

    rollouts: Sequence[VerifiedRollout]
    prompt_ids: Sequence[int]
    secret: bytes


def spot_check_group(
    rollouts: Sequence[VerifiedRollout],
    prompt_ids: Sequence[int],
    oracle: DistributionOracle,
    secret: bytes,
    chunks_per_audit: int,
    tolerance: Tolerance | Tolerances,
) -> list[SpotCheckResult | SpotCheckFailed]:
    """Checks 1-3 for rollouts of one assignment (one prompt, version and sampling parameters)."""
    return spot_check_jobs(
        [SpotJob(rollouts, prompt_ids, secret)], oracle, chunks_per_audit, tolerance
    )[0]


def spot_check_jobs(
    jobs: Sequence[SpotJob],
    oracle: DistributionOracle,
    chunks_per_audit: int,
    tolerance: Tolerance | Tolerances,
) -> list[list[SpotCheckResult | SpotCheckFailed]]:
    """Checks 1-3 for several assignments at once; one result list per job, in order.

    ``chunks_per_audit`` 0 replays the sampler on every chunk; k > 0 on k drawn ones.
    Each rollout is held to the tolerance of the precision its header declares (the
    caller has checked that there is one).

    One batched forward pass per policy version over every rollout of every
    job, then each check runs once over the stacked rows of all rollouts that
    share sampling parameters and audit secret; only when a stacked check
    fails are those rollouts re-checked one by one to attribute the failure.
    A job's results do not depend on which other jobs share its batch.
    """
    tolerances = Tolerances.coerce(tolerance)
    flat = [(j, r, job) for j, job in enumerate(jobs) for r in job.rollouts]
    drawn = [_replayed_chunks(job.secret, r, chunks_per_audit) for _, r, job in flat]
    out: list[SpotCheckResult | SpotCheckFailed] = [
        SpotCheckResult(d, np.zeros(0, np.float32), np.zeros(0), 0.0) for d in drawn
    ]
    live = [i for i, (_, r, _) in enumerate(flat) if r.header.token_count]
    logits: dict[int, np.ndarray] = {}
    for version in sorted({flat[i][1].header.policy_version for i in live}):
        idx = [i for i in live if flat[i][1].header.policy_version == version]
        seqs = [
            (
                list(flat[i][2].prompt_ids) + flat[i][1].token_ids.tolist(),
                len(flat[i][2].prompt_ids),
            )
            for i in idx
        ]
        for i, lg in zip(idx, oracle.logits_batch(version, seqs), strict=True):
            logits[i] = np.asarray(lg, dtype=np.float32)
    parts: dict[tuple, list[int]] = {}
    for i in live:
        h = flat[i][1].header
        s = h.sampling
        parts.setdefault(
            (s.temperature, s.top_k, s.top_p, s.sampler, h.precision, flat[i][2].secret), []
        ).append(i)
    for (*_, precision, secret), idx in parts.items():
        tolerance_ = tolerances.of(precision)
        fast = _stacked(
            [flat[i][1] for i in idx],
            [logits[i] for i in idx],
            [drawn[i] for i in idx],
            tolerance_,
            secret,
        )
        for j, i in enumerate(idx):
            out[i] = (
                fast[j]
                if fast is not None
                else _one(flat[i][1], logits[i], drawn[i], tolerance_, secret)
            )
    results: list[list[SpotCheckResult | SpotCheckFailed]] = [[] for _ in jobs]
    for (j, _, _), result in zip(flat, out, strict=True):
        results[j].append(result)
    return results


def _replayed_chunks(secret: bytes, r: VerifiedRollout, chunks_per_audit: int) -> list[int]:
    """The chunks of ``r`` the sampler is replayed on: all of them, or k drawn under the secret."""
    total = n_chunks(r.header.token_count, r.header.chunk_size)
    if chunks_per_audit == 0:
        return list(range(total))
    return chunks_to_open(secret, r.digest, total, chunks_per_audit)


def _one(
    r: VerifiedRollout, logits: np.ndarray, chunks: list[int], tolerance: Tolerance, secret: bytes
) -> SpotCheckResult | SpotCheckFailed:
    s = r.header.sampling
    processed = process_logits(torch.from_numpy(logits), s.temperature, s.top_k, s.top_p)
    try:
        recomputed, worst, gaps = _check(r, logits, chunks, tolerance, processed)
    except SpotCheckError as exc:
        return SpotCheckFailed(exc, chunks, _token_logprobs(processed, r.token_ids))
    pit = pit_values(
        r.token_ids.astype(np.int64),
        processed,
        pit_randomizer(secret, r.digest, r.header.token_count),
    )
    evidence = _evidence(r, recomputed, gaps, tolerance)
    return SpotCheckResult(chunks, recomputed, pit, worst, evidence)


def _stacked(
    rollouts: list[VerifiedRollout],
    logits: list[np.ndarray],
    drawn: list[list[int]],
    tolerance: Tolerance,
    secret: bytes,
) -> list[SpotCheckResult | SpotCheckFailed] | None:
    """All checks over the stacked rows of every rollout; None if any check fails."""
    s = rollouts[0].header.sampling
    stacked = np.concatenate(logits)  # (sum T, V)
    processed = process_logits(torch.from_numpy(stacked), s.temperature, s.top_k, s.top_p)
    tokens = np.concatenate([r.token_ids for r in rollouts]).astype(np.int64)
    recomputed = _token_logprobs(processed, tokens)
    starts = np.cumsum([0] + [r.header.token_count for r in rollouts])
    worst = _chunk_worst(rollouts, recomputed, starts, tolerance)
    if worst is None:
        return None
    rows: list[int] = []
    specs: list[NoiseSpec] = []
    replayed = [0]  # where each rollout's replayed rows start in ``rows``
    for k, r in enumerate(rollouts):
        h, base = r.header, int(starts[k])
        for c in drawn[k]:
            lo, hi = c * h.chunk_size, min((c + 1) * h.chunk_size, h.token_count)
            rows.extend(range(base + lo, base + hi))
            specs.append(
                (h.contributor_key, h.nonce, h.sampling.seed, h.group_index, range(lo, hi))
            )
        replayed.append(len(rows))
    gaps = np.zeros(0)
    try:
        if rows:
            sel = np.asarray(rows)
            sampler = sampler_named(s.sampler)
            support_check(tokens[sel], stacked[sel], s.temperature, s.top_k, s.top_p)
            stats = sampler.replay(
                tokens[sel],
                stacked[sel],
                s.temperature,
                s.top_k,
                s.top_p,
                sampler.randomness(specs, stacked.shape[-1]),
                slack=sampler.slack(tolerance),
                processed=processed if len(rows) == len(tokens) else processed[sel],
            )
            gaps = _gaps(stats)
    except SpotCheckError:
        return None
    randomizer = np.concatenate(
        [pit_randomizer(secret, r.digest, r.header.token_count) for r in rollouts]
    )
    pit = pit_values(tokens, processed, randomizer)
    out: list[SpotCheckResult | SpotCheckFailed] = []
    for k, r in enumerate(rollouts):
        mine = recomputed[starts[k] : starts[k + 1]]
        evidence = _evidence(r, mine, gaps[replayed[k] : replayed[k + 1]], tolerance)
        out.append(
            SpotCheckResult(drawn[k], mine, pit[starts[k] : starts[k + 1]], worst[k], evidence)
        )
    return out


def _chunk_worst(
    rollouts: list[VerifiedRollout],
    recomputed: np.ndarray,
    starts: np.ndarray,
    tolerance: Tolerance,
) -> list[float] | None:
    """``compare_chunk`` over every chunk of every rollout at once: each rollout's largest
    |diff|, or None if any chunk fails (the caller re-checks one by one for the error)."""
    claimed = np.concatenate([r.logprobs for r in rollouts])
    if claimed.size == 0:
        return [0.0] * len(rollouts)
    diff = token_diffs(claimed, recomputed, tolerance)
    bounds = [
        int(starts[k]) + lo
        for k, r in enumerate(rollouts)
        for lo in range(0, r.header.token_count, r.header.chunk_size)
    ]
    edges = np.asarray(bounds + [claimed.size])
    chunk_max = np.maximum.reduceat(diff, edges[:-1])
    sizes = np.diff(edges)
    chunk_mean = np.add.reduceat(diff, edges[:-1]) / sizes
    judged = sizes >= MIN_MEAN_TOKENS
    if bool(
        (chunk_max > tolerance.token_abs).any()
        | (judged & (chunk_mean > tolerance.chunk_mean_abs)).any()
    ):
        return None
    return [
        float(diff[starts[k] : starts[k + 1]].max()) if starts[k + 1] > starts[k] else 0.0
        for k in range(len(rollouts))
    ]


def _token_logprobs(processed: torch.Tensor, token_ids: np.ndarray) -> np.ndarray:
    idx = torch.from_numpy(token_ids.astype(np.int64))[:, None]
    return processed.gather(-1, idx)[:, 0].numpy().astype(np.float32)


def build_evidence(
    reason: Reason,
    envelope_bytes: bytes,
    assignment: SignedAssignment,
    prompt_ids: Sequence[int],
    chunks: list[int],
    recomputed: np.ndarray | None,
    tolerance: Tolerance,
    detail: str,
) -> bytes:
    ev = SlashEvidence(
        reason=reason.value,
        envelope=envelope_bytes,
        assignment=canonical_bytes(assignment),
        prompt_ids=np.asarray(prompt_ids, dtype=_U32).tobytes(),
        chunks=list(chunks),
        recomputed=b"" if recomputed is None else np.asarray(recomputed, _F32).tobytes(),
        token_abs=tolerance.token_abs,
        chunk_mean_abs=tolerance.chunk_mean_abs,
        detail=detail[:1_024],
        replay_slack=tolerance.replay_slack,
    )
    return canonical_bytes(ev)


def recheck_evidence(
    evidence: bytes,
    validator: PublicKey,
    oracle: DistributionOracle | None = None,
    limits: Limits = Limits(),
) -> Reason:
    """Re-verify slash evidence offline; return the offence it proves.

    1. the assignment is signed by the validator and the envelope by the
       contributor it was assigned to;
    2. for header offences (WRONG_PROMPT, ASSIGNMENT_MISMATCH, STOPPING_RULE) the
       signed header or body contradicts the signed assignment;
    3. for spot-check offences, recomputation with ``oracle`` (the claimed
       policy version's weights) reproduces the failure at the stated tolerance.

    A DIVERGENCE slash is not re-checked here: its proof is the contributor's
    ``DivergenceRecorded`` entries, which ``ledger.audit`` replays.

    Raises :class:`VerificationError` when the evidence does not prove its claim.
    """
    # Its bytes are fixed by the digest the ledger holds; evidence written before
    # ``replay_slack`` existed lacks that trailing field.
    ev = decode(SlashEvidence, evidence, max_bytes=len(evidence), canonical=False)
    reason = Reason(ev.reason)
    sealed = decode(SignedAssignment, ev.assignment, max_bytes=len(ev.assignment))
    assignment = open_sealed(WorkAssignment, sealed, validator)
    rollout = verify_envelope(ev.envelope, limits, expected_key=assignment.contributor_key)
    if reason in (Reason.WRONG_PROMPT, Reason.ASSIGNMENT_MISMATCH, Reason.STOPPING_RULE):
        try:
            header_matches(rollout, assignment)
            check_stopping_rule(
                rollout.token_ids, assignment.sampling.max_tokens, assignment.stop_token_ids
            )
        except VerificationError as exc:
            if exc.reason is reason:
                return reason
        raise VerificationError(
            "evidence does not show the claimed header offence",
            reason=Reason.INCONSISTENT,
            expected=reason.value,
        )
    if reason is Reason.DIVERGENCE:
        raise VerificationError(
            "a divergence alarm is proven by the contributor's divergence entries in the ledger, "
            "not by one rollout: `prooftrain audit verify` replays them",
            reason=Reason.INCONSISTENT,
            expected=reason.value,
        )
    if oracle is None:
        raise VerificationError(
            "re-checking a spot-check offence needs the policy's weights",
            reason=Reason.INCONSISTENT,
        )
    prompt_ids = np.frombuffer(ev.prompt_ids, _U32).tolist()
    tolerance = Tolerance(ev.token_abs, ev.chunk_mean_abs, ev.replay_slack)
    logits = oracle.completion_logits(
        rollout.header.policy_version, [*prompt_ids, *rollout.token_ids.tolist()], len(prompt_ids)
    )
    try:
        _check(rollout, logits, list(ev.chunks), tolerance)
    except SpotCheckError as exc:
        if exc.reason is reason:
            return reason
        raise VerificationError(
            "recomputation fails, but for another reason",
            reason=Reason.INCONSISTENT,
            expected=reason.value,
            computed=exc.reason.value,
        ) from None
    raise VerificationError(
        "recomputation does not reproduce the offence",
        reason=Reason.INCONSISTENT,
        expected=reason.value,
    )


def header_matches(rollout: VerifiedRollout, a: WorkAssignment) -> None:
    """The signed header answers exactly the signed assignment."""
    h = rollout.header
    if h.prompt_id != a.prompt_id or h.prompt_digest != a.prompt_digest or h.task_id != a.task_id:
        raise VerificationError(
            "rollout answers another prompt",
            reason=Reason.WRONG_PROMPT,
            expected=a.prompt_id,
            computed=h.prompt_id,
        )
    pairs = {
        "assignment_id": (a.assignment_id, h.assignment_id),
        "nonce": (a.nonce, h.nonce),
        "contributor_key": (a.contributor_key, h.contributor_key),
        "group_size": (a.group_size, h.group_size),
        "policy_version": (a.policy_version, h.policy_version),
        "manifest_digest": (a.manifest_digest, h.manifest_digest),
        "sampling": (a.sampling, h.sampling),
        "chunk_size": (a.chunk_size, h.chunk_size),
    }
    for name, (want, got) in pairs.items():
        if want != got:
            raise VerificationError(
                f"header {name} differs from the assignment",
                reason=Reason.ASSIGNMENT_MISMATCH,
                expected=want,
                computed=got,
            )
