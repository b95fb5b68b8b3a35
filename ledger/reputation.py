"""Per-contributor Beta reputation: a pure function of the log.

Each contributor holds a Beta(alpha, beta) belief that its next spot check
passes. Evidence decays towards the prior by ``decay`` at every new
observation of that contributor, so recent behaviour dominates::

    alpha' = prior_pass + decay * (alpha - prior_pass) + [passed]
    beta'  = prior_fail + decay * (beta  - prior_fail) + fail_weight * [failed]
                                                       + slash_weight * [slashed]
                                                       + discard_weight * [discarded]

``score = alpha / (alpha + beta)``. A contributor is banned once a failed check leaves its
score below ``ban_threshold``, or it is slashed; a ban is permanent.
Only audited verdicts move reputation (an unaudited accept proves nothing). An
assignment answered with anything but a valid group, or abandoned (:data:`DISCARDS`),
is drawn for audit like a group, and counts as a discard when drawn: discards and
passes are sampled at the same rate, so a contributor discarding a share f of its
assignments holds a score near (1 - f) / (1 + (discard_weight - 1) f), which lowers its
aggregation weight and raises its audit rate. A discard never bans on its own (a ban
follows a failed check or a slash): a newcomer whose machine dies holding its
assignments is not banned for it.

Invariants: ``apply`` uses only IEEE-754 additions, multiplications and
divisions in a fixed order, so replaying the same log on any machine
reproduces every stored state bit for bit. Parameters come from the log's
first entry (:class:`ledger.records.LogCreated`), never from local config.
"""

from __future__ import annotations

from msgspec import Struct

from ledger.records import LogCreated, Record, Slashed, VerdictRecorded
from verify.errors import Reason

DISCARDS = frozenset(
    r.value
    for r in (
        Reason.ABANDONED,
        Reason.MISSING_GROUP_MEMBER,
        Reason.DUPLICATE_GROUP_MEMBER,
        Reason.UNSUPPORTED_PRECISION,
        Reason.EXPIRED_ASSIGNMENT,
        Reason.STALE,
        Reason.MALFORMED,
    )
)
"""Reasons an assignment ends without a judged group: it was abandoned, or answered with a
group that fails before any spot check, which costs the contributor nothing it could not
choose. Each holds its contributor's place like an abandoned assignment, gives its prompt
back, and counts against reputation when its draw picks it."""


PROBATION_ROLLOUTS = 32
"""Audited rollouts a new key is on probation for: audited at rate 1 (:func:`audit_rate`) and
weighed at most ``PROBATION_WEIGHT`` in aggregation (:func:`aggregation_weight`). Fixed by the
log format, as ``discard_weight`` is."""
PROBATION_WEIGHT = 0.5


class ReputationParams(Struct, frozen=True):
    prior_pass: float = 1.0
    prior_fail: float = 1.0
    fail_weight: float = 3.0
    """A failed check counts this many times a passed one."""
    slash_weight: float = 20.0
    decay: float = 0.98
    """Per-observation retention of past evidence (half-life about 34 observations)."""
    ban_threshold: float = 0.2
    min_audit_rate: float = 0.02
    """Floor of the audit rate for long-standing, well-behaved contributors."""
    novelty: float = 4.0
    """Evidence mass at which a contributor stops counting as new (its novelty term halves)."""
    risk_gain: float = 4.0
    """How strongly the share of failure evidence raises the audit rate."""
    discard_weight: float = 1.0
    """A drawn discard counts this many times a passed check. Fixed by the log format (no log
    entry sets it): logs written before discards were drawn hold none."""

    @classmethod
    def from_record(cls, rec: LogCreated) -> ReputationParams:
        return cls(
            rec.prior_pass,
            rec.prior_fail,
            rec.fail_weight,
            rec.slash_weight,
            rec.decay,
            rec.ban_threshold,
            rec.min_audit_rate,
            rec.novelty,
            rec.risk_gain,
        )


class ReputationState(Struct, frozen=True):
    contributor: bytes
    alpha: float
    beta: float
    passed: int = 0
    failed: int = 0
    slashed: int = 0
    banned: bool = False
    last_index: int = -1

    @property
    def score(self) -> float:
        return self.alpha / (self.alpha + self.beta)


def initial(contributor: bytes, params: ReputationParams) -> ReputationState:
    return ReputationState(contributor, params.prior_pass, params.prior_fail)


def outcome(record: Record) -> tuple[int, int, int, int] | None:
    """(passed, failed, slashed, discarded) a record contributes, or None if it does not move
    reputation."""
    if isinstance(record, VerdictRecorded):
        if not record.audited:
            return None
        if record.accepted:
            return (1, 0, 0, 0)
        return (0, 0, 0, 1) if record.reason in DISCARDS else (0, 1, 0, 0)
    if isinstance(record, Slashed):
        return (0, 0, 1, 0)
    return None


def apply(
    state: ReputationState,
    params: ReputationParams,
    passed: int,
    failed: int,
    slashed: int,
    discarded: int,
    index: int,
) -> ReputationState:
    """State after one observation at log ``index`` (a discard is counted in ``failed``)."""
    alpha = params.prior_pass + params.decay * (state.alpha - params.prior_pass) + passed
    beta = (
        params.prior_fail
        + params.decay * (state.beta - params.prior_fail)
        + params.fail_weight * failed
        + params.slash_weight * slashed
        + params.discard_weight * discarded
    )
    low = alpha / (alpha + beta) < params.ban_threshold
    banned = state.banned or slashed > 0 or (failed > 0 and low)
    return ReputationState(
        state.contributor,
        alpha,
        beta,
        state.passed + passed,
        state.failed + failed + discarded,
        state.slashed + slashed,
        banned,
        index,
    )


def audit_rate(state: ReputationState | None, params: ReputationParams) -> float:
    """Probability that a contributor's next rollout is spot-checked.

    New contributors (little evidence) and those with recent failures are
    checked more::

        good, bad = alpha - prior_pass, beta - prior_fail      (decayed evidence)
        novelty   = novelty / (novelty + good + bad)           (1 for a newcomer)
        risk      = bad / (novelty + good + bad)               (share of failure evidence)
        rate      = min + (1 - min) * min(1, novelty + risk_gain * risk)

    Unknown and banned contributors, and new ones on probation (fewer than
    ``PROBATION_ROLLOUTS`` audited rollouts), are always checked.
    """
    if state is None or state.banned or on_probation(state):
        return 1.0
    good = max(state.alpha - params.prior_pass, 0.0)
    bad = max(state.beta - params.prior_fail, 0.0)
    denom = params.novelty + good + bad
    novelty = params.novelty / denom if denom > 0 else 1.0
    risk = bad / denom if denom > 0 else 0.0
    pressure = min(1.0, novelty + params.risk_gain * risk)
    return params.min_audit_rate + (1.0 - params.min_audit_rate) * pressure


def aggregation_weight(state: ReputationState | None, params: ReputationParams) -> float:
    """A contributor's weight in robust aggregation: its score, at most ``PROBATION_WEIGHT``
    while it is on probation (a fresh key cannot buy full weight with a few honest groups)."""
    if state is None:
        state = initial(b"", params)
    return min(state.score, PROBATION_WEIGHT) if on_probation(state) else state.score


def on_probation(state: ReputationState) -> bool:
    """Fewer than ``PROBATION_ROLLOUTS`` audited rollouts (drawn discards among them)."""
    return state.passed + state.failed < PROBATION_ROLLOUTS


class Replay:
    """Folds records into reputation states, in log order."""

    def __init__(self, params: ReputationParams | None = None) -> None:
        self.params = params
        self.states: dict[bytes, ReputationState] = {}

    def feed(self, index: int, record: Record) -> ReputationState | None:
        if isinstance(record, LogCreated):
            if self.params is None:
                self.params = ReputationParams.from_record(record)
            return None
        delta = outcome(record)
        if delta is None:
            return None
        if self.params is None:
            raise ValueError("reputation replay needs the log's LogCreated entry first")
        key = record.contributor  # type: ignore[union-attr]
        state = self.states.get(key) or initial(key, self.params)
        new = apply(state, self.params, *delta, index)
        self.states[key] = new
        return new
