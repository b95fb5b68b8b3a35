"""What a running node tells its operator: log lines and gauges, read from the ledger it writes.

Every event an operator cares about is a ledger record, so one background
thread (:class:`ActivityLog`) follows the ledger from where it stood at start
and, at INFO on the ``prooftrain.validator`` logger:

- logs one line per registration, policy publication, slash and ban (a
  contributor whose reputation crossed the ban threshold), naming contributors
  by key fingerprint only;
- every ``summary_s`` seconds logs an admission summary: rollouts accepted,
  rejected by reason, audited, the queue depth, since the previous summary;
- keeps the Prometheus gauges that describe the log current: ledger size,
  policy version and when it was published, audit rate (the fraction of
  rollouts judged since start that were audited), contributors registered,
  banned and active (a verdict in the last ``active_window_s`` seconds), and
  how far the latest signed checkpoint trails the log.

Reading the ledger, not hooking admission, keeps these numbers equal to what
an auditor would count, and costs admission nothing. ``--log-format json``
writes one JSON object per line (``JsonFormatter``).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ledger.log import Ledger
from ledger.records import (
    ContributorRegistered,
    LogCreated,
    PolicyPublished,
    Slashed,
    VerdictRecorded,
)
from verify.keys import PublicKey

LOG = logging.getLogger("prooftrain.validator")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and any ``extra`` fields."""

    _STANDARD = set(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in self._STANDARD})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Log to stderr at ``level``, as text lines or (``fmt="json"``) JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def fingerprint(raw: bytes) -> str:
    return PublicKey(raw).fingerprint


class ActivityLog:
    """Follows ``ledger`` from its current size; ``poll()`` handles what was appended since."""

    def __init__(
        self,
        ledger: Ledger,
        gauges: Any,
        queue_depth: Callable[[], int],
        summary_s: float = 30.0,
        *,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        active_window_s: float = 600.0,
    ) -> None:
        """``gauges`` is ``node.validator.service.Metrics``; ``clock_ms`` is the clock the
        ledger's ``at_ms`` fields were written with."""
        self.ledger, self.gauges, self.queue_depth = ledger, gauges, queue_depth
        self.summary_s, self.clock_ms, self.active_window_s = summary_s, clock_ms, active_window_s
        self.position = ledger.size()
        self.version = 0
        self.published_ms = 0  # when the current version was published (0: when the log began)
        self.registered: set[bytes] = set()
        self.last_verdict_ms: dict[bytes, int] = {}  # one entry per contributor ever judged
        self.banned: set[bytes] = set()
        self.accepted = self.audited = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.seen = self.seen_audited = 0  # rollouts judged since start, and how many were audited
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="validator-activity", daemon=True)
        self._scan_history()

    def _scan_history(self) -> None:
        """Gauges as of start-up: policy version and bans so far (nothing is logged for them)."""
        judged: set[bytes] = set()
        for _, rec in self.ledger.entries(0, self.position):
            if isinstance(rec, LogCreated):
                self.published_ms = rec.at_ms
            elif isinstance(rec, PolicyPublished) and rec.version >= self.version:
                self.version, self.published_ms = rec.version, rec.at_ms
            elif isinstance(rec, ContributorRegistered):
                self.registered.add(rec.contributor)
            elif isinstance(rec, (Slashed, VerdictRecorded)):
                judged.add(rec.contributor)
                if isinstance(rec, VerdictRecorded):
                    self.last_verdict_ms[rec.contributor] = rec.at_ms
        self.banned = {c for c in judged if self.ledger.is_banned(c)}
        self._set_gauges(self.position)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then handle the last entries and log a final summary."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.poll()
        self.summary()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(1.0):
            self.poll()
            if time.monotonic() - last >= self.summary_s:
                self.summary()
                last = time.monotonic()

    def poll(self) -> None:
        size = self.ledger.size()
        watch: set[bytes] = set()
        for _, rec in self.ledger.entries(self.position, size):
            self._event(rec, watch)
        for contributor in watch - self.banned:
            if self.ledger.is_banned(contributor):
                self.banned.add(contributor)
                LOG.info(
                    "ban: contributor %s",
                    fingerprint(contributor),
                    extra={"event": "ban", "contributor": fingerprint(contributor)},
                )
        self.position = size
        self._set_gauges(size)

    def _event(self, rec: object, watch: set[bytes]) -> None:
        if isinstance(rec, VerdictRecorded):
            self.last_verdict_ms[rec.contributor] = rec.at_ms
            self.audited += rec.audited
            self.seen += 1
            self.seen_audited += rec.audited
            if rec.accepted:
                self.accepted += 1
            else:
                self.rejected[rec.reason] += 1
                watch.add(rec.contributor)
        elif isinstance(rec, ContributorRegistered):
            self.registered.add(rec.contributor)
            LOG.info(
                "registration: contributor %s (%r)",
                fingerprint(rec.contributor),
                rec.name,
                extra={"event": "registration", "contributor": fingerprint(rec.contributor)},
            )
        elif isinstance(rec, PolicyPublished):
            if rec.version >= self.version:
                self.version, self.published_ms = rec.version, rec.at_ms
            LOG.info(
                "policy published: version %d (manifest %s)",
                rec.version,
                rec.manifest_digest.hex()[:16],
                extra={"event": "policy", "version": rec.version},
            )
        elif isinstance(rec, Slashed):
            watch.add(rec.contributor)
            LOG.info(
                "slash: contributor %s for %s",
                fingerprint(rec.contributor),
                rec.reason,
                extra={
                    "event": "slash",
                    "contributor": fingerprint(rec.contributor),
                    "reason": rec.reason,
                },
            )

    def summary(self) -> None:
        """Log what was admitted since the last summary, then start counting afresh."""
        total = self.accepted + sum(self.rejected.values())
        rejected = ", ".join(f"{r} {n}" for r, n in self.rejected.most_common()) or "none"
        LOG.info(
            "admission: %d rollouts, %d accepted, rejected: %s; %d audited; queue depth %d; "
            "ledger %d entries, policy version %d",
            total,
            self.accepted,
            rejected,
            self.audited,
            self.queue_depth(),
            self.position,
            self.version,
            extra={
                "event": "admission",
                "accepted": self.accepted,
                "rejected": dict(self.rejected),
                "audited": self.audited,
                "queue_depth": self.queue_depth(),
                "ledger_size": self.position,
                "policy_version": self.version,
            },
        )
        self.accepted = self.audited = 0
        self.rejected.clear()

    def _set_gauges(self, size: int) -> None:
        now_ms = self.clock_ms()
        g = self.gauges
        g.ledger_size.set(size)
        g.policy_version.set(self.version)
        g.policy_published.set(self.published_ms / 1000)
        g.policy_age.set(max(0, now_ms - self.published_ms) / 1000)
        g.banned.set(len(self.banned))
        since_ms = now_ms - self.active_window_s * 1000
        active = sum(1 for at in self.last_verdict_ms.values() if at >= since_ms)
        for state, n in (
            ("registered", len(self.registered)),
            ("banned", len(self.banned)),
            ("active", active),
        ):
            g.contributors.labels(state).set(n)
        if self.seen:
            g.audit_rate.set(self.seen_audited / self.seen)
        self._checkpoint_gauges(size, now_ms)

    def _checkpoint_gauges(self, size: int, now_ms: int) -> None:
        latest = self.ledger.latest_checkpoint()
        covered = 0 if latest is None else latest.checkpoint.size
        self.gauges.checkpoint_size.set(covered)
        age_ms = 0
        if covered < size:
            for _, oldest_uncovered in self.ledger.entries(covered, covered + 1):
                age_ms = max(0, now_ms - oldest_uncovered.at_ms)
        self.gauges.checkpoint_age.set(age_ms / 1000)
