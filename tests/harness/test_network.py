"""Simulated network: determinism, latency distributions, drops, reordering, churn."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.network import (
    ChurnModel,
    DeliveryQueue,
    NetworkProfile,
    SimulatedNetwork,
    available_latency_models,
    constant,
    lognormal,
    make_latency,
    pareto,
)
from verify.errors import ConfigError


def _net(seed: int = 1, **profile) -> SimulatedNetwork:  # noqa: ANN003
    p = NetworkProfile(**{"latency": lognormal(50, 0.5), **profile})
    return SimulatedNetwork({"a": p, "b": p}, seed=seed)


def test_same_seed_same_delays_and_different_seed_differs() -> None:
    one, two, other = _net(3, drop_rate=0.1), _net(3, drop_rate=0.1), _net(4, drop_rate=0.1)
    seq = [("a", "submission"), ("b", "assignment"), ("a", "weights")] * 50
    d1 = [one.delay(c, k) for c, k in seq]
    assert d1 == [two.delay(c, k) for c, k in seq]
    assert d1 != [other.delay(c, k) for c, k in seq]


def test_streams_do_not_depend_on_interleaving() -> None:
    one, two = _net(5, jitter_ms=10, reorder_rate=0.2), _net(5, jitter_ms=10, reorder_rate=0.2)
    a_first = [one.delay("a", "x") for _ in range(20)] + [one.delay("b", "x") for _ in range(20)]
    interleaved = [(two.delay("a", "x"), two.delay("b", "x")) for _ in range(20)]
    assert a_first[:20] == [p[0] for p in interleaved]
    assert a_first[20:] == [p[1] for p in interleaved]


def _samples(model, n: int = 20_000, seed: int = 0) -> np.ndarray:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    return np.array([model.sample(rng) for _ in range(n)])


def test_pareto_tail_is_much_heavier_than_lognormal() -> None:
    heavy, light = _samples(pareto(20, 1.1)), _samples(lognormal(50, 0.5))
    ratio_heavy = np.quantile(heavy, 0.99) / np.quantile(heavy, 0.5)
    ratio_light = np.quantile(light, 0.99) / np.quantile(light, 0.5)
    assert ratio_light < 4.5  # exp(0.5 * 2.326) = 3.2
    assert ratio_heavy > 5 * ratio_light  # (0.01 / 0.5) ** (-1 / 1.1) = 35
    assert heavy.min() >= 0.020


@pytest.mark.parametrize("model", [lognormal(40, 0.7), pareto(10, 1.5), constant(25)])
def test_empirical_quantiles_match_the_model(model) -> None:  # noqa: ANN001
    xs = _samples(model)
    for q in (0.5, 0.9):
        assert np.quantile(xs, q) == pytest.approx(model.quantile(q), rel=0.08)


def test_drop_rate_within_binomial_bounds() -> None:
    n, p = 20_000, 0.1
    net = _net(11, drop_rate=p)
    drops = sum(net.delay("a", "submission") is None for _ in range(n))
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(drops - n * p) < 5 * sigma
    assert all(_net(11).delay("a", "s") is not None for _ in range(1_000))


def test_jitter_bounds_delay() -> None:
    net = SimulatedNetwork({"a": NetworkProfile(constant(10), jitter_ms=5)}, seed=0)
    ds = [net.delay("a", "s") for _ in range(2_000)]
    assert min(ds) >= 0.010 and max(ds) <= 0.015
    assert max(ds) - min(ds) > 0.004


def _arrival_order(net: SimulatedNetwork, n: int = 500) -> list[int]:
    q = DeliveryQueue()
    for i in range(n):
        net.send(q, "a", "submission", i, now=i * 0.001)
    out = q.pop_ready(now=1e9)
    assert len(q) == 0
    return out


def test_reordering_happens_and_fifo_without_it() -> None:
    steady = SimulatedNetwork({"a": NetworkProfile(constant(10))}, seed=0)
    assert _arrival_order(steady) == list(range(500))
    reordering = SimulatedNetwork({"a": NetworkProfile(constant(10), reorder_rate=0.3)}, seed=0)
    order = _arrival_order(reordering)
    assert sorted(order) == list(range(500))
    inversions = sum(x > y for x, y in zip(order, order[1:], strict=False))
    assert inversions > 20


def test_dropped_messages_are_never_delivered() -> None:
    net = _net(2, drop_rate=0.3)
    q = DeliveryQueue()
    sent = [i for i in range(300) if net.send(q, "a", "s", i, now=0.0)]
    assert 150 < len(sent) < 270
    assert sorted(q.pop_ready(1e9)) == sent


@given(st.lists(st.floats(0, 100, allow_nan=False), max_size=50), st.floats(0, 100))
def test_delivery_queue_yields_each_message_once_in_time_order(
    times: list[float], now: float
) -> None:
    q = DeliveryQueue()
    for i, t in enumerate(times):
        q.push((t, i), t)
    ready = q.pop_ready(now)
    assert ready == sorted((t, i) for i, t in enumerate(times) if t <= now)
    nxt = q.next_ready_at()
    assert nxt is None or nxt > now
    assert sorted(ready + q.pop_ready(1e9)) == sorted((t, i) for i, t in enumerate(times))


def test_compute_speed_scales_generation_time() -> None:
    net = SimulatedNetwork(
        {"fast": NetworkProfile(compute_speed=2.0), "slow": NetworkProfile(compute_speed=0.5)},
        seed=0,
    )
    assert net.compute_time("fast", 4.0) == pytest.approx(2.0)
    assert net.compute_time("slow", 4.0) == pytest.approx(8.0)


def test_churn_schedule_alternates_and_matches_the_stationary_fraction() -> None:
    model = ChurnModel(mean_online_s=30, mean_offline_s=10)
    horizon = 200_000.0
    intervals = model.schedule(np.random.default_rng(0), horizon)
    assert intervals[0][0] == 0.0
    assert all(a < b for a, b in intervals)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(intervals, intervals[1:], strict=False))
    online = sum(b - a for a, b in intervals) / horizon
    assert online == pytest.approx(0.75, abs=0.03)


def test_is_online_agrees_with_churn_events_and_ignores_query_order() -> None:
    def build() -> SimulatedNetwork:
        p = NetworkProfile()
        return SimulatedNetwork(
            {"a": p, "stable": p}, seed=9, churn=ChurnModel(20, 10), churning={"a"}
        )

    forward, backward = build(), build()
    ts = np.linspace(0, 1_000, 400)
    assert [forward.is_online("a", t) for t in ts] == [
        backward.is_online("a", t) for t in ts[::-1]
    ][::-1]
    events = forward.churn_events("a", 1_000)
    assert events and events[0][1] == "leave"
    assert [k for _, k in events] == ["leave", "join"] * (len(events) // 2) + ["leave"] * (
        len(events) % 2
    )
    for t, kind in events:
        assert forward.is_online("a", t + 1e-9) == (kind == "join")
        assert forward.is_online("a", t - 1e-9) == (kind == "leave")
    assert all(forward.is_online("stable", t) for t in ts)
    assert forward.churn_events("stable", 1_000) == []


def test_next_online_returns_the_next_join() -> None:
    net = SimulatedNetwork({"a": NetworkProfile()}, seed=1, churn=ChurnModel(5, 50))
    leave = next(t for t, k in net.churn_events("a", 10_000) if k == "leave")
    back = net.next_online("a", leave + 1e-6)
    assert back > leave and net.is_online("a", back)
    assert not net.is_online("a", (leave + back) / 2)
    assert net.next_online("a", back) == back


def test_bad_parameters_are_config_errors() -> None:
    assert available_latency_models() == ["constant", "lognormal", "pareto"]
    with pytest.raises(ConfigError, match="known: constant, lognormal, pareto"):
        make_latency("weibull", shape=1)
    with pytest.raises(ConfigError, match="alpha"):
        make_latency("pareto", scale_ms=10, alpha=0)
    with pytest.raises(ConfigError, match="unexpected keyword"):
        make_latency("constant", median_ms=3)
    with pytest.raises(ConfigError, match="drop_rate"):
        NetworkProfile(drop_rate=1.0)
    with pytest.raises(ConfigError, match="compute_speed"):
        NetworkProfile(compute_speed=0)
    with pytest.raises(ConfigError, match="mean_offline_s"):
        ChurnModel(10, -1)
    with pytest.raises(ConfigError, match="no network profile"):
        _net().delay("nobody", "s")


def test_drops_do_not_shift_the_other_delays() -> None:
    lossless, lossy = _net(8, jitter_ms=3), _net(8, jitter_ms=3, drop_rate=0.4)
    pairs = [(lossless.delay("a", "s"), lossy.delay("a", "s")) for _ in range(200)]
    assert any(d is None for _, d in pairs)
    assert all(d is None or d == full for full, d in pairs)


def test_late_joiners_start_offline() -> None:
    net = SimulatedNetwork(
        {"a": NetworkProfile()}, seed=3, churn=ChurnModel(100, 10, start_online=False)
    )
    assert not net.is_online("a", 0.0)
    first = net.churn_events("a", 1e6)[0]
    assert first[1] == "join" and net.is_online("a", first[0] + 1e-9)
    assert net.next_online("a", 0.0) == first[0]
