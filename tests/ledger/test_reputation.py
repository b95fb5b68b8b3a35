"""Beta reputation: weighting, decay, bans, audit rate, deterministic replay."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ledger.reputation import Replay, ReputationParams, apply, audit_rate, initial

P = ReputationParams()
K = b"\x01" * 32


def run(outcomes: list[tuple[int, int, int]] | list[tuple[int, int, int, int]]):
    s = initial(K, P)
    for i, o in enumerate(outcomes):
        s = apply(s, P, *(tuple(o) + (0,) * (4 - len(o))), i)
    return s


def test_failures_weigh_more_than_passes() -> None:
    one_each = run([(1, 0, 0), (0, 1, 0)])
    assert one_each.score < 0.5
    assert run([(1, 0, 0)]).score > 0.5 > run([(0, 1, 0)]).score


def test_decay_forgets_old_failures() -> None:
    early_failure = run([(0, 1, 0)] + [(1, 0, 0)] * 200)
    late_failure = run([(1, 0, 0)] * 200 + [(0, 1, 0)])
    assert early_failure.score > late_failure.score
    assert early_failure.beta - P.prior_fail < 0.1  # almost forgotten


def test_ban_threshold_and_slash() -> None:
    assert not run([(0, 1, 0)]).banned  # one failed check: suspicious, not banned
    assert run([(0, 1, 0), (0, 1, 0)]).banned
    assert run([(1, 0, 0)] * 50 + [(0, 0, 1)]).banned  # a proven offence bans at once
    banned = run([(0, 0, 1)] + [(1, 0, 0)] * 500)
    assert banned.banned and banned.score > 0.9  # bans are permanent


def test_audit_rate() -> None:
    assert audit_rate(None, P) == 1.0
    fresh = run([(1, 0, 0)])
    veteran = run([(1, 0, 0)] * 300)
    shaky = run([(1, 0, 0)] * 300 + [(0, 1, 0)])
    assert 1.0 >= audit_rate(fresh, P) > audit_rate(shaky, P) > audit_rate(veteran, P)
    assert audit_rate(veteran, P) >= P.min_audit_rate
    assert audit_rate(run([(0, 0, 1)]), P) == 1.0


GENESIS_PARAMS = ReputationParams(fail_weight=2.0, decay=0.9, ban_threshold=0.1)
"""Not the defaults: a replay that used local parameters instead of the log's would differ."""
OTHER = b"\x02" * 32


def genesis():  # type: ignore[no-untyped-def]
    from ledger.records import LogCreated

    p = GENESIS_PARAMS
    return LogCreated(
        "t",
        K,
        p.prior_pass,
        p.prior_fail,
        p.fail_weight,
        p.slash_weight,
        p.decay,
        p.ban_threshold,
        p.min_audit_rate,
        p.novelty,
        p.risk_gain,
        0,
    )


def record(contributor: bytes, kind: int):  # type: ignore[no-untyped-def]
    """0: audited pass, 1: audited failure, 2: slash, 3: unaudited accept (moves nothing)."""
    from ledger.records import Slashed, VerdictRecorded

    if kind == 2:
        return Slashed(contributor, "bad_logprobs", "", b"\x00" * 32, b"", 0)
    return VerdictRecorded(
        contributor,
        b"\x00" * 16,
        0,
        b"\x00" * 32,
        kind != 1,
        "bad_logprobs" if kind == 1 else "",
        kind != 3,
        b"",
        0,
    )


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=120))
def test_replay_is_deterministic(events) -> None:
    log = [genesis()] + [record(OTHER if other else K, kind) for other, kind in events]
    first, second = Replay(), Replay()
    for index, rec in enumerate(log):
        first.feed(index, rec)
    for index, rec in enumerate(log):
        second.feed(index, rec)
    assert first.params == GENESIS_PARAMS and first.states == second.states
    moves = {0: (1, 0, 0, 0), 1: (0, 1, 0, 0), 2: (0, 0, 1, 0)}
    for who in (K, OTHER):
        want = initial(who, GENESIS_PARAMS)
        for index, (other, kind) in enumerate(events, start=1):
            if (OTHER if other else K) == who and kind in moves:
                want = apply(want, GENESIS_PARAMS, *moves[kind], index)
        assert first.states.get(who, initial(who, GENESIS_PARAMS)) == want
        assert 0.0 < want.score < 1.0 and 0.0 < audit_rate(want, GENESIS_PARAMS) <= 1.0


def test_replay_requires_parameters() -> None:
    from ledger.records import VerdictRecorded

    r = Replay()
    rec = VerdictRecorded(K, b"\x00" * 16, 0, K, True, "", True, b"", 0)
    try:
        r.feed(1, rec)
    except ValueError:
        pass
    else:
        raise AssertionError("replay without LogCreated must refuse")


def _verdict(reason: str, audited: bool):  # type: ignore[no-untyped-def]
    from ledger.records import VerdictRecorded

    return VerdictRecorded(K, b"\x00" * 16, 0, b"\x00" * 32, not reason, reason, audited, b"", 0)


def test_a_drawn_discard_counts_as_one_pass_counts_and_an_undrawn_one_not_at_all() -> None:
    from ledger.reputation import DISCARDS, outcome

    assert outcome(_verdict("abandoned", True)) == (0, 0, 0, 1)
    assert outcome(_verdict("missing_group_member", True)) == (0, 0, 0, 1)
    assert outcome(_verdict("abandoned", False)) is None
    assert outcome(_verdict("logprob_mismatch", True)) == (0, 1, 0, 0)
    assert {"stale", "expired_assignment", "unsupported_precision", "malformed"} <= DISCARDS
    discard, fail, ok = run([(0, 0, 0, 1)]), run([(0, 1, 0, 0)]), run([(1, 0, 0, 0)])
    assert fail.score < discard.score == 1 / 3 < ok.score
    assert discard.failed == 1 and discard.beta == P.prior_fail + P.discard_weight


def test_discards_lower_the_score_and_raise_the_audit_rate_but_never_ban_alone() -> None:
    def share(f: float, n: int = 2_000) -> float:
        # discards and passes drawn at the same rate: a fraction f of the observations
        moves = [(0, 0, 0, 1) if (i * f) % 1 + f >= 1 else (1, 0, 0, 0) for i in range(n)]
        return run(moves).score

    assert share(0.9) < P.ban_threshold < share(0.3) and share(0.3) > 0.6
    # discards alone never ban, even a newcomer's; the next failed check then does
    crashed = run([(0, 0, 0, 1)] * 8)
    assert crashed.score < P.ban_threshold and not crashed.banned
    assert run([(0, 0, 0, 1)] * 8 + [(0, 1, 0, 0)]).banned
    assert audit_rate(crashed, P) == 1.0
