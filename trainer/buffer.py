"""A bounded buffer of accepted groups, fed from a sample source by cursor.

The source is the validator's accepted-sample stream (``SampleSource.fetch``:
ledger order, resumable by cursor). The buffer collects samples into groups
(one per assignment) and releases only complete groups.

Invariants:
- Every accepted sample the source serves is, exactly once, either trained
  (``take``), dropped as stale, or still held by the buffer. ``state()`` holds
  the cursor *and* the held samples, so a checkpoint taken between steps
  resumes without training a sample twice or skipping one.
- A ``fill`` that raises (a stop while it waits, a starved source) takes
  nothing: the groups it had taken are held again, ahead of the others.
- Staleness is judged at use time: a group of policy version ``p`` taken at
  trainer version ``v`` is dropped when ``v - p > max_staleness``
  (``sync=True``: when ``p != v``).
- At most ``capacity`` samples are held; the buffer stops fetching when full.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from trainer.batch import Group, uniform_reward
from verify.errors import ProofTrainError
from verify.types import AcceptedSample, SampleBatch, canonical_bytes, decode


class StarvedError(ProofTrainError):
    """The source produced no usable groups within the wait budget."""


@runtime_checkable
class SampleSource(Protocol):
    """The accepted-sample stream: samples from ledger index ``cursor`` on."""

    def fetch(self, cursor: int, limit: int) -> SampleBatch: ...


@dataclass
class Taken:
    """What one ``take`` released and dropped."""

    groups: list[Group]
    stale_dropped: int = 0
    uniform_dropped: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    dropped: list[int] = field(default_factory=list)
    """Ledger indices of the samples consumed without training (stale or uniform)."""


class SampleBuffer:
    """See the module docstring. Not thread-safe: one trainer loop owns it."""

    def __init__(
        self,
        source: SampleSource,
        *,
        max_staleness: int,
        capacity: int = 4096,
        page: int = 256,
        cursor: int = 0,
        skip_uniform: bool = True,
        sync: bool = False,
    ) -> None:
        if max_staleness < 0 or capacity < 1 or page < 1:
            raise ValueError("need max_staleness >= 0, capacity >= 1, page >= 1")
        self.source = source
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.page = page
        self.cursor = cursor
        self.skip_uniform = skip_uniform
        self.sync = sync
        self.filling: Taken | None = None
        """What the ``fill`` in progress (or the last one) has released and dropped so far."""
        self.stale_dropped_total = 0
        """Rollouts dropped as stale by every ``take`` since this buffer was made."""
        self.uniform_dropped_total = 0
        """Rollouts in uniform-reward groups consumed untrained since this buffer was made."""
        # assignment id -> members seen so far, in arrival (ledger) order of first member
        self._pending: dict[bytes, list[AcceptedSample]] = {}
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def poll(self) -> int:
        """Fetch one page if there is room; return how many samples arrived."""
        room = self.capacity - self._held
        if room <= 0:
            return 0
        batch = self.source.fetch(self.cursor, min(self.page, room))
        if batch.cursor != self.cursor or batch.next_cursor < self.cursor:
            raise ProofTrainError(
                f"source answered cursor {batch.cursor}->{batch.next_cursor} for {self.cursor}"
            )
        for s in batch.samples:
            self._pending.setdefault(s.assignment_id, []).append(s)
        self._held += len(batch.samples)
        self.cursor = batch.next_cursor
        return len(batch.samples)

    def _too_old(self, age: int) -> bool:
        return age > (0 if self.sync else self.max_staleness)

    def take(self, n_groups: int, version: int) -> Taken:
        """Release up to ``n_groups`` complete, fresh-enough groups, oldest first.

        Stale groups (complete or not) are dropped on the way; with
        ``skip_uniform`` a complete group whose rewards are all equal is
        consumed without training (its advantages would all be zero).
        """
        out = Taken(groups=[])
        for aid in list(self._pending):
            members = self._pending[aid]
            age = version - members[0].policy_version
            if self._too_old(age):
                out.stale_dropped += len(members)
                out.dropped += [s.ledger_index for s in members]
                self._drop(aid)
                continue
            if len(out.groups) >= n_groups or len(members) < members[0].group_size or age < 0:
                continue
            group = tuple(sorted(members, key=lambda s: s.group_index))
            self._drop(aid)
            if self.skip_uniform and uniform_reward(group):
                out.uniform_dropped += len(group)
                out.dropped += [s.ledger_index for s in group]
                continue
            out.groups.append(group)
            out.staleness[age] += len(group)
        self.stale_dropped_total += out.stale_dropped
        self.uniform_dropped_total += out.uniform_dropped
        return out

    def fill(
        self,
        n_groups: int,
        version: int,
        *,
        wait: Callable[[], None] | None = None,
        timeout_s: float = 600.0,
    ) -> Taken:
        """Poll and take until ``n_groups`` groups are released.

        ``wait`` runs when the source had nothing new (default: sleep 0.2 s);
        ``StarvedError`` when ``timeout_s`` passes without enough groups.
        """
        deadline = time.monotonic() + timeout_s
        got = Taken(groups=[])
        self.filling = got  # progress so far, for a ``wait`` that reports it
        try:
            return self._fill(got, n_groups, version, wait, deadline, timeout_s)
        except BaseException:
            self._put_back(got.groups)  # a fill that does not return takes no group
            raise

    def _fill(
        self,
        got: Taken,
        n_groups: int,
        version: int,
        wait: Callable[[], None] | None,
        deadline: float,
        timeout_s: float,
    ) -> Taken:
        while True:
            arrived = self.poll()
            part = self.take(n_groups - len(got.groups), version)
            got.groups += part.groups
            got.stale_dropped += part.stale_dropped
            got.uniform_dropped += part.uniform_dropped
            got.staleness += part.staleness
            got.dropped += part.dropped
            if len(got.groups) >= n_groups:
                return got
            if time.monotonic() > deadline:
                raise StarvedError(
                    f"only {len(got.groups)} of {n_groups} groups for version {version} "
                    f"after {timeout_s}s"
                )
            if arrived == 0:
                (wait or (lambda: time.sleep(0.2)))()

    def _put_back(self, groups: list[tuple[AcceptedSample, ...]]) -> None:
        """Hold ``groups`` again, ahead of everything held (they arrived first)."""
        back = {g[0].assignment_id: list(g) for g in groups}
        self._held += sum(len(g) for g in groups)
        self._pending = {**back, **self._pending}

    def _drop(self, aid: bytes) -> None:
        self._held -= len(self._pending.pop(aid))

    # -- checkpointing

    def state(self) -> dict:
        """The cursor and every held sample (canonical bytes), in arrival order."""
        held = [canonical_bytes(s) for members in self._pending.values() for s in members]
        return {"cursor": self.cursor, "held": held}

    def load_state(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self._pending = {}
        self._held = 0
        for raw in state["held"]:
            s = decode(AcceptedSample, raw, max_bytes=len(raw))
            self._pending.setdefault(s.assignment_id, []).append(s)
            self._held += 1
