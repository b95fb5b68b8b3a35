"""Per-chunk logprob comparison and the oracle Protocol shapes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify.errors import Reason, SpotCheckError
from verify.spotcheck import (
    BFLOAT16_TOLERANCE,
    FLOAT32_TOLERANCE,
    ChunkStats,
    LogprobOracle,
    OracleRequest,
    Tolerance,
    compare_chunk,
)

TOL = Tolerance(token_abs=1e-3, chunk_mean_abs=1e-4)


def _chunk(seed: int = 0, n: int = 32) -> np.ndarray:
    return -np.abs(np.random.default_rng(seed).normal(size=n)).astype(np.float32)


def test_identical_chunk_passes_with_stats():
    c = _chunk()
    stats = compare_chunk(c, c.copy(), TOL, 3)
    assert stats == ChunkStats(3, 32, 0.0, 0.0, 0)


def test_small_noise_passes_and_reports_worst_position():
    c = _chunk()
    r = c.copy()
    r[5] += 5e-4
    stats = compare_chunk(c, r, TOL, 0, position_offset=64)
    assert stats.worst_position == 69
    assert stats.max_abs_diff == pytest.approx(5e-4, rel=1e-3)
    assert stats.mean_abs_diff == pytest.approx(5e-4 / 32, rel=1e-3)


def test_one_edited_token_is_caught_at_its_position():
    c = _chunk()
    r = c.copy()
    c[11] = np.float32(-0.01)  # the contributor claims a likelier token than it was
    with pytest.raises(SpotCheckError) as info:
        compare_chunk(c, r, TOL, 2, position_offset=64)
    err = info.value
    assert err.reason is Reason.LOGPROB_MISMATCH
    assert err.chunk_index == 2 and err.position == 75
    assert err.expected == pytest.approx(-0.01) and err.computed == pytest.approx(float(r[11]))


def test_many_small_shifts_fail_on_the_mean():
    c = _chunk()
    r = c + np.float32(5e-4)  # every token under token_abs, mean over chunk_mean_abs
    with pytest.raises(SpotCheckError) as info:
        compare_chunk(c, r, TOL, 0)
    assert info.value.reason is Reason.LOGPROB_MISMATCH


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 0.5])
def test_non_finite_or_positive_claims_fail(bad):
    c = _chunk()
    r = c.copy()
    c[4] = bad
    with pytest.raises(SpotCheckError) as info:
        compare_chunk(c, r, TOL, 0)
    assert info.value.position == 4


def test_claim_against_off_support_recomputation_fails():
    c = _chunk()
    r = c.copy()
    r[0] = -np.inf
    with pytest.raises(SpotCheckError) as info:
        compare_chunk(c, r, TOL, 0)
    assert info.value.position == 0


def test_shape_mismatch_is_inconsistent():
    with pytest.raises(SpotCheckError) as info:
        compare_chunk(_chunk(n=32), _chunk(n=31), TOL, 0)
    assert info.value.reason is Reason.INCONSISTENT


@given(
    st.lists(st.floats(-30, 0, width=32), min_size=1, max_size=64),
    st.floats(0, 5e-4),
    st.integers(0, 63),
)
def test_noise_under_tolerance_always_passes(values, shift, where):
    c = np.array(values, dtype=np.float32)
    r = c.astype(np.float64)
    r[where % len(values)] -= shift
    stats = compare_chunk(c, r, Tolerance(1e-3, 1e-3), 0)
    assert stats.max_abs_diff <= 1e-3


def test_tolerance_validation():
    for bad in [(0.0, 0.0), (-1.0, 0.1), (float("nan"), 0.1), (0.1, 0.2)]:
        with pytest.raises(ValueError):
            Tolerance(*bad)
    assert FLOAT32_TOLERANCE.token_abs < BFLOAT16_TOLERANCE.token_abs


def test_oracle_request_and_protocol():
    with pytest.raises(ValueError):
        OracleRequest((1, 2, 3), 0, 1.0, 0, 1.0)
    assert OracleRequest((1, 2, 3), 1, 1.0, 0, 1.0).completion_len == 2

    class Fixed:
        def logprobs(self, version, input_ids, prompt_len, temperature, top_k, top_p):
            return np.zeros(len(input_ids) - prompt_len, dtype=np.float32)

        def logprobs_batch(self, version, requests):
            return [
                self.logprobs(version, r.input_ids, r.prompt_len, 1.0, 0, 1.0) for r in requests
            ]

    assert isinstance(Fixed(), LogprobOracle)
    assert not isinstance(object(), LogprobOracle)
