"""The harness run's event log: one JSON object per line, appended and flushed line by line.

runner → report, compare. Every event carries ``kind`` (the tag), ``run``
(``scenario``, ``honest`` or ``no-defence``) and, except ``audit``, ``t``: the
simulated time in seconds since that run started. Events of one kind are
written in time order; an eval is written when its report comes back
(``harness.background_evals``), after the steps trained meanwhile, and its
``t`` is its version's. A crash loses at most the
line being written; readers skip a torn final line and reject any other bad
line with its line number.

    with EventLog(out / EVENTS_FILE) as log:
        log.write(Eval(t=0.0, run="scenario", step=0, version=0, pass_at_1=0.2,
                       ci_low=0.12, ci_high=0.3, mean_reward=0.2))
    events = read_run_dir(out)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from verify.errors import ProofTrainError

RUNS = ("scenario", "honest", "no-defence")
"""Run labels: the scenario itself, the all-honest baseline, the no-defence ablation."""
HONEST = "honest"
"""The strategy name of an honest contributor."""
EVENTS_FILE = "events.jsonl"
"""The log's name inside a run directory; ``read_run_dir`` also reads ``events-*.jsonl``."""


class EventLogError(ProofTrainError):
    """An event log that cannot be read (missing, or a bad line other than a torn last one)."""


class _Event(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=False):
    pass


class Start(_Event, tag="start", frozen=True):
    """A run begins. ``contributors`` maps contributor id → strategy name."""

    run: str
    scenario: str
    seed: int
    contributors: dict[str, str]
    t: float = 0.0


class Eval(_Event, tag="eval", frozen=True):
    """Held-out pass@1 of policy ``version`` after optimizer step ``step`` (Wilson 95% CI)."""

    t: float
    run: str
    step: int
    version: int
    pass_at_1: float
    ci_low: float
    ci_high: float
    mean_reward: float


class TrainStep(_Event, tag="train_step", frozen=True):
    """One optimizer step: ``staleness`` has one entry per sample (current version − its version);
    ``grad_norms`` maps contributor fingerprint → norm of its gradient before aggregation;
    ``samples_by`` fingerprint → samples of the step's batch signed by that key; ``weight_share``
    fingerprint → its share of the aggregation weight (``trainer.rl``: its coefficient in the
    aggregate over the sum of the coefficients) and ``update_share`` of the update (coefficient
    times gradient norm, over their sum); a key whose gradient was dropped as non-finite has
    samples but no share."""

    t: float
    run: str
    step: int
    version: int
    samples: int
    staleness: list[int]
    loss: float
    reward_mean: float
    ratio_mean: float
    masked_fraction: float
    grad_norms: dict[str, float]
    samples_by: dict[str, int] = {}
    weight_share: dict[str, float] = {}
    update_share: dict[str, float] = {}


class Verdict(_Event, tag="verdict", frozen=True):
    """The validator's verdict on one group submission; ``reason`` is "" when accepted,
    ``reward`` the validator's mean reward (None when rejected before scoring), ``key`` the
    fingerprint of the key that signed it."""

    t: float
    run: str
    contributor: str
    strategy: str
    accepted: bool
    reason: str
    audited: bool
    reward: float | None = None
    key: str = ""


class Slash(_Event, tag="slash", frozen=True):
    """A contributor was slashed (evidence recorded in the ledger); ``key``: which of its keys."""

    t: float
    run: str
    contributor: str
    strategy: str
    reason: str
    key: str = ""


class Reputation(_Event, tag="reputation", frozen=True):
    """A contributor's reputation after a change, of its key ``key`` (fingerprint). A key's
    first event is its registration: at the run's start, or when a banned contributor comes
    back under a fresh key (whitewashing)."""

    t: float
    run: str
    contributor: str
    strategy: str
    score: float
    banned: bool
    audit_rate: float
    key: str = ""


class Throughput(_Event, tag="throughput", frozen=True):
    """Accepted samples per simulated second over the last interval."""

    t: float
    run: str
    samples_per_s: float


class Audit(_Event, tag="audit", frozen=True):
    """``audit verify`` on the run's ledger at the end: ``findings`` are their string forms."""

    run: str
    ok: bool
    size: int
    findings: list[str] = []


class Summary(_Event, tag="summary", frozen=True):
    """End of a run: free-form figures (wall_s, steps, samples, ledger path, ...)."""

    run: str
    t: float = 0.0
    values: dict[str, Any] = {}


Event = Start | Eval | TrainStep | Verdict | Slash | Reputation | Throughput | Audit | Summary
KINDS = (
    "start",
    "eval",
    "train_step",
    "verdict",
    "slash",
    "reputation",
    "throughput",
    "audit",
    "summary",
)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(line: bytes | str) -> Event:
    return _decoder.decode(line)


class EventLog:
    """Append-only JSONL writer; every ``write`` is one flushed line. Thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()/__exit__
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        line = _encoder.encode(event) + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def write_all(self, events: Iterable[Event]) -> None:
        for e in events:
            self.write(e)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a final line that a crash left without its newline, so appending stays line-aligned."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


def read_events(path: str | Path) -> list[Event]:
    """Every event in ``path``, in file order. A torn last line (no newline) is skipped."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise EventLogError(f"cannot read event log {p}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    out: list[Event] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(_decoder.decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if n == len(lines):  # the final line had no newline: a write cut short
                break
            raise EventLogError(f"{p}:{n}: bad event: {exc}") from None
    return out


def run_dir_logs(run_dir: str | Path) -> list[Path]:
    d = Path(run_dir)
    return sorted(p for p in d.glob("events*.jsonl") if p.is_file())


def read_run_dir(run_dir: str | Path) -> list[Event]:
    """Events of every log in ``run_dir`` (``events.jsonl`` and ``events-*.jsonl``)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise EventLogError(f"run directory {d} does not exist")
    logs = run_dir_logs(d)
    if not logs:
        raise EventLogError(f"{d}: no event log ({EVENTS_FILE}) found")
    return [e for p in logs for e in read_events(p)]
