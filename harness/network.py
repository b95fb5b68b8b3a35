"""Simulated network between contributors and the validator: latency, jitter, drops, churn.

Pure and seeded: nothing here opens a socket, sleeps or reads a clock. The
runner keeps a simulated clock, asks :class:`SimulatedNetwork` how long each
message takes (``None`` when it is dropped) and whether a contributor is online
at time ``t``, and delivers messages through a :class:`DeliveryQueue` in
simulated-time order, which reorders them exactly as the delays dictate.

Determinism: every (contributor, message kind) pair draws from its own random
stream, derived from the network seed and the pair's names with a stable hash.
The same seed and the same sequence of calls per pair give the same delays,
however calls for different pairs interleave (threads, asynchronous runners).

    net = SimulatedNetwork({"c00": NetworkProfile(lognormal(40, 0.5))}, seed=7)
    q = DeliveryQueue()
    net.send(q, "c00", "submission", msg, now=0.0)   # False when dropped
    for m in q.pop_ready(now=1.0): ...
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from verify.errors import ConfigError

MAX_DELAY_S = 3_600.0
"""Every delay is capped here: a Pareto tail with alpha <= 1 has no mean."""


@runtime_checkable
class LatencyModel(Protocol):
    """One-way latency distribution. ``sample`` returns seconds (>= 0)."""

    @property
    def name(self) -> str: ...

    def sample(self, rng: np.random.Generator) -> float: ...

    def quantile(self, q: float) -> float:
        """The q-quantile in seconds (0 < q < 1), for reports and tests."""
        ...


LATENCY_MODELS: dict[str, Callable[..., LatencyModel]] = {}


def register_latency_model(
    name: str,
) -> Callable[[Callable[..., LatencyModel]], Callable[..., LatencyModel]]:
    def deco(factory: Callable[..., LatencyModel]) -> Callable[..., LatencyModel]:
        if name in LATENCY_MODELS:
            raise ValueError(f"latency model {name!r} registered twice")
        LATENCY_MODELS[name] = factory
        return factory

    return deco


def available_latency_models() -> list[str]:
    return sorted(LATENCY_MODELS)


def make_latency(name: str, **params: Any) -> LatencyModel:
    """Build the latency model registered as ``name``; ``ConfigError`` on a bad name or parameter."""
    try:
        factory = LATENCY_MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown latency model {name!r} (known: {', '.join(available_latency_models())})"
        ) from None
    try:
        return factory(**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"latency model {name!r}: {exc}") from None


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@register_latency_model("lognormal")
@dataclass(frozen=True)
class LogNormal:
    """exp(N(log median, sigma^2)) milliseconds: the usual shape of wide-area round trips."""

    median_ms: float
    sigma: float = 0.5
    name: str = field(default="lognormal", init=False)

    def __post_init__(self) -> None:
        _positive("median_ms", self.median_ms)
        if not (math.isfinite(self.sigma) and 0 <= self.sigma <= 5):
            raise ValueError(f"sigma must be in [0, 5], got {self.sigma!r}")

    def sample(self, rng: np.random.Generator) -> float:
        return min(self.median_ms / 1e3 * math.exp(self.sigma * rng.standard_normal()), MAX_DELAY_S)

    def quantile(self, q: float) -> float:
        from statistics import NormalDist  # noqa: PLC0415

        return min(
            self.median_ms / 1e3 * math.exp(self.sigma * NormalDist().inv_cdf(q)), MAX_DELAY_S
        )


@register_latency_model("pareto")
@dataclass(frozen=True)
class Pareto:
    """Pareto(scale, alpha) milliseconds, support [scale, inf): heavy-tailed stragglers.

    P(X > x) = (scale / x)^alpha, so alpha <= 2 has infinite variance and
    alpha <= 1 an infinite mean; samples are capped at ``MAX_DELAY_S``.
    """

    scale_ms: float
    alpha: float = 1.5
    name: str = field(default="pareto", init=False)

    def __post_init__(self) -> None:
        _positive("scale_ms", self.scale_ms)
        if not (math.isfinite(self.alpha) and 0.1 <= self.alpha <= 20):
            raise ValueError(f"alpha must be in [0.1, 20], got {self.alpha!r}")

    def sample(self, rng: np.random.Generator) -> float:
        # numpy's pareto is the Lomax (Pareto II) law: 1 + X is the classic Pareto.
        return min(self.scale_ms / 1e3 * (1.0 + rng.pareto(self.alpha)), MAX_DELAY_S)

    def quantile(self, q: float) -> float:
        return min(self.scale_ms / 1e3 * (1.0 - q) ** (-1.0 / self.alpha), MAX_DELAY_S)


@register_latency_model("constant")
@dataclass(frozen=True)
class Constant:
    """Always ``ms`` milliseconds."""

    ms: float
    name: str = field(default="constant", init=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ms) and 0 <= self.ms <= MAX_DELAY_S * 1e3):
            raise ValueError(f"ms must be in [0, {MAX_DELAY_S * 1e3:g}], got {self.ms!r}")

    def sample(self, rng: np.random.Generator) -> float:
        return self.ms / 1e3

    def quantile(self, q: float) -> float:
        return self.ms / 1e3


def lognormal(median_ms: float, sigma: float = 0.5) -> LogNormal:
    return LogNormal(median_ms, sigma)


def pareto(scale_ms: float, alpha: float = 1.5) -> Pareto:
    return Pareto(scale_ms, alpha)


def constant(ms: float) -> Constant:
    return Constant(ms)


@dataclass(frozen=True)
class NetworkProfile:
    """How one contributor's link and hardware behave.

    A delivered message takes ``latency.sample() + U(0, jitter_ms)`` seconds,
    plus, with probability ``reorder_rate``, a second latency sample (a held
    packet that overtakes nothing but is overtaken). It is lost with
    probability ``drop_rate``. ``compute_speed`` is the hardware multiplier:
    generation that takes ``base_s`` on reference hardware takes
    ``base_s / compute_speed`` here (2.0 is twice as fast, 0.5 half as fast).
    """

    latency: LatencyModel = field(default_factory=lambda: LogNormal(50.0, 0.3))
    jitter_ms: float = 0.0
    drop_rate: float = 0.0
    reorder_rate: float = 0.0
    compute_speed: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.latency, LatencyModel):
            raise ConfigError(f"latency must be a LatencyModel, got {type(self.latency).__name__}")
        if not (math.isfinite(self.jitter_ms) and 0 <= self.jitter_ms <= 60_000):
            raise ConfigError(f"jitter_ms must be in [0, 60000], got {self.jitter_ms!r}")
        for name in ("drop_rate", "reorder_rate"):
            value = getattr(self, name)
            if not (0.0 <= value < 1.0):
                raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
        if not (math.isfinite(self.compute_speed) and 0.01 <= self.compute_speed <= 100):
            raise ConfigError(f"compute_speed must be in [0.01, 100], got {self.compute_speed!r}")


@dataclass(frozen=True)
class ChurnModel:
    """Alternating online/offline periods with exponential durations (a two-state Markov chain).

    A contributor starts online at t = 0 when ``start_online`` (the default:
    every contributor joins at the start), otherwise it first joins after an
    offline period.
    """

    mean_online_s: float
    mean_offline_s: float
    start_online: bool = True

    def __post_init__(self) -> None:
        for name in ("mean_online_s", "mean_offline_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1e7):
                raise ConfigError(f"{name} must be in (0, 1e7], got {value!r}")

    def toggles(self, rng: np.random.Generator, until: float) -> list[float]:
        """Times in (0, until] at which the state flips (the first flip leaves when
        ``start_online``, joins otherwise)."""
        state, t, out = self.start_online, 0.0, list[float]()
        while True:
            t += rng.exponential(self.mean_online_s if state else self.mean_offline_s)
            if t > until:
                return out
            out.append(t)
            state = not state

    def schedule(self, rng: np.random.Generator, horizon_s: float) -> list[tuple[float, float]]:
        """Online intervals ``(join, leave)`` covering [0, horizon_s]; the last may end at horizon."""
        flips = [0.0] if self.start_online else []
        flips += self.toggles(rng, horizon_s)
        if len(flips) % 2:
            flips.append(horizon_s)
        return [(flips[i], flips[i + 1]) for i in range(0, len(flips), 2)]


def stream_seed(seed: int, *labels: str) -> np.random.SeedSequence:
    """A stable child seed for ``labels`` (Python's ``hash`` is salted per process; this is not)."""
    h = hashlib.sha256(repr((int(seed), *labels)).encode()).digest()
    return np.random.SeedSequence([int.from_bytes(h[i : i + 4], "little") for i in range(0, 16, 4)])


class _Churn:
    """One contributor's online/offline flips, drawn one at a time as far as anyone has asked.

    The flip sequence depends only on the random stream, never on which times
    were queried, so answers are the same whatever order the runner asks in.
    """

    def __init__(self, model: ChurnModel, rng: np.random.Generator) -> None:
        self.model, self.rng = model, rng
        self.flips: list[float] = []

    def extend(self, t: float) -> None:
        while not self.flips or self.flips[-1] <= t:
            online = self.model.start_online ^ (len(self.flips) % 2 == 1)
            mean = self.model.mean_online_s if online else self.model.mean_offline_s
            self.flips.append((self.flips[-1] if self.flips else 0.0) + self.rng.exponential(mean))

    def online(self, t: float) -> bool:
        self.extend(t)
        return self.model.start_online ^ (bisect.bisect_right(self.flips, t) % 2 == 1)


class SimulatedNetwork:
    """Per-contributor delays, drops and churn, deterministic for ``seed``.

    ``profiles`` maps contributor ids to their :class:`NetworkProfile`;
    ``churn`` applies to every contributor in ``churning`` (all of them when
    ``churning`` is None) and never to the others.
    """

    def __init__(
        self,
        profiles: Mapping[str, NetworkProfile],
        seed: int,
        churn: ChurnModel | None = None,
        churning: set[str] | None = None,
    ) -> None:
        self.profiles = dict(profiles)
        self.seed = int(seed)
        self.churn = churn
        self.churning = set(self.profiles) if churning is None else set(churning)
        self._rngs: dict[tuple[str, str], np.random.Generator] = {}
        self._churn: dict[str, _Churn] = {}

    def profile(self, contributor: str) -> NetworkProfile:
        try:
            return self.profiles[contributor]
        except KeyError:
            raise ConfigError(f"no network profile for contributor {contributor!r}") from None

    def _rng(self, contributor: str, kind: str) -> np.random.Generator:
        key = (contributor, kind)
        if key not in self._rngs:
            self._rngs[key] = np.random.default_rng(
                stream_seed(self.seed, "net", contributor, kind)
            )
        return self._rngs[key]

    def delay(self, contributor: str, kind: str) -> float | None:
        """Seconds until a ``kind`` message between ``contributor`` and the validator arrives
        (kinds are free-form labels such as "assignment", "submission", "weights"); ``None``
        when it is dropped. Every call makes the same draws whatever happens, so one
        outcome never shifts the randomness of the next."""
        p = self.profile(contributor)
        rng = self._rng(contributor, kind)
        u_drop, u_jitter, u_reorder = rng.random(3)
        base, held = p.latency.sample(rng), p.latency.sample(rng)
        if u_drop < p.drop_rate:
            return None
        extra = held if u_reorder < p.reorder_rate else 0.0
        return min(base + extra + u_jitter * p.jitter_ms / 1e3, MAX_DELAY_S)

    def compute_time(self, contributor: str, base_s: float) -> float:
        """Generation time on this contributor's hardware for ``base_s`` on reference hardware."""
        return base_s / self.profile(contributor).compute_speed

    def _schedule(self, contributor: str) -> _Churn | None:
        if self.churn is None or contributor not in self.churning:
            return None
        if contributor not in self._churn:
            rng = np.random.default_rng(stream_seed(self.seed, "churn", contributor))
            self._churn[contributor] = _Churn(self.churn, rng)
        return self._churn[contributor]

    def is_online(self, contributor: str, t: float) -> bool:
        self.profile(contributor)
        sched = self._schedule(contributor)
        return True if sched is None else sched.online(t)

    def churn_events(self, contributor: str, until: float) -> list[tuple[float, str]]:
        """``(t, "join" | "leave")`` for every state change in (0, until]."""
        sched = self._schedule(contributor)
        if sched is None:
            return []
        sched.extend(until)
        online = self.churn.start_online if self.churn else True
        out = []
        for f in sched.flips:
            if f > until:
                break
            online = not online
            out.append((f, "join" if online else "leave"))
        return out

    def next_online(self, contributor: str, t: float) -> float:
        """The earliest time >= t at which ``contributor`` is online."""
        sched = self._schedule(contributor)
        if sched is None or sched.online(t):
            return t
        return sched.flips[bisect.bisect_right(sched.flips, t)]

    def send(
        self, queue: DeliveryQueue, contributor: str, kind: str, message: Any, now: float
    ) -> bool:
        """Queue ``message`` for delivery at ``now + delay``; False (and nothing queued) if dropped."""
        d = self.delay(contributor, kind)
        if d is None:
            return False
        queue.push(message, now + d)
        return True


class DeliveryQueue:
    """Messages in flight, delivered in order of arrival time (ties: order of sending).

    Every pushed message is popped exactly once, at the first ``pop_ready(now)``
    with ``now >= ready_at``.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()

    def push(self, message: Any, ready_at: float) -> None:
        if not math.isfinite(ready_at):
            raise ValueError(f"ready_at must be finite, got {ready_at!r}")
        heapq.heappush(self._heap, (float(ready_at), next(self._seq), message))

    def pop_ready(self, now: float) -> list[Any]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def next_ready_at(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
