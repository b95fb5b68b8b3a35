"""The audit-draw epoch secret: committed, held by admissions, revealed, replaced.

Which rollouts are spot-checked is a keyed draw (``verify.challenge.should_audit``)
under a per-epoch secret. A contributor must not learn the secret while it can
still choose what to submit under it, and an auditor must be able to re-check
every draw afterwards. Hence the lifecycle of one epoch:

1. Start: 32 fresh bytes from ``entropy``, stored in the state store, and
   ``EpochCommitted(epoch, commitment)`` appended to the ledger.
2. Use: each admission draws the secret (:meth:`EpochSecrets.draw`) and holds
   it until its verdicts are in the ledger (:meth:`EpochSecrets.release`).
3. End: once ``epoch_groups`` recorded submissions have been counted, no new
   admission may draw the secret (they wait, or, admitted in a batch with
   others, are refused with BACKPRESSURE and retried alone); when the last
   holder releases,
   ``EpochRevealed(epoch, secret)`` is appended, the state store marks the
   epoch revealed, and the next epoch starts.

Invariants:
- A secret is revealed only after every group drawn with it is recorded, so a
  reveal can never help the group it keyed.
- Epoch numbers increase by one from the last ``EpochCommitted`` in the
  ledger; on start-up, every epoch the state store holds unrevealed is
  revealed before a new one begins. On a log several nodes append to, the
  number is checked in the commitment's own write transaction (``follow``
  learns the epochs other nodes committed): a number another node took is
  never committed twice; the next free one is taken instead.
- Once the validator serves requests, every epoch change happens under the
  lock it shares with the validator, so no assignment or registration record
  is appended between an ``EpochRevealed`` and the next ``EpochCommitted``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ledger.log import Ledger
from ledger.records import EpochCommitted, EpochRevealed
from node.config import ValidatorConfig
from node.validator.state import State
from verify.challenge import epoch_commitment


class EpochSecrets:
    """The current epoch and its secret, with the count of admissions holding it."""

    def __init__(
        self,
        cfg: ValidatorConfig,
        ledger: Ledger,
        state: State,
        lock: threading.RLock,
        clock: Callable[[], int],
        entropy: Callable[[int], bytes],
    ) -> None:
        self.cfg, self.ledger, self.state = cfg, ledger, state
        self.clock, self.entropy = clock, entropy
        self._lock = lock
        self._cv = threading.Condition(lock)
        self._users = 0  # admissions holding the current epoch's secret
        self._rolling = False  # an epoch change waits for those admissions
        self._submissions = 0  # recorded submissions in the current epoch
        self.epoch = 0
        self._secret = b""
        self.follow: Callable[[int], None] | None = None
        """Learns, up to a ledger index, what other nodes appended (``Validator.follow``),
        calling :meth:`seen` for each epoch they committed; None on a log this node alone
        writes."""
        self._taken = 0  # the last epoch another node committed

    def seen(self, epoch: int) -> None:
        """Another node committed ``epoch``: this node's next epoch comes after it."""
        self._taken = max(self._taken, epoch)

    def resume(self, last_epoch: int) -> None:
        """Reveal epochs left unrevealed by a previous run, then start ``last_epoch + 1``."""
        for epoch, secret in self.state.unrevealed_epochs():
            self.ledger.append(EpochRevealed(epoch, secret, self.clock()))
            self.state.mark_revealed(epoch)
        self.epoch = last_epoch
        self._start_next()

    def _start_next(self) -> None:
        with self._lock:
            while True:
                epoch = max(self.epoch, self._taken) + 1
                secret = self.entropy(32)
                self.state.put_epoch(epoch, secret)
                try:
                    self.ledger.append_many(
                        [EpochCommitted(epoch, epoch_commitment(epoch, secret), self.clock())],
                        check=None if self.follow is None else self._free(epoch),
                    )
                except _Taken:  # never committed: nothing to reveal
                    self.state.mark_revealed(epoch)
                    continue
                break
            self.epoch, self._secret = epoch, secret
            self._submissions = 0

    def _free(self, epoch: int) -> Callable[[int], None]:
        """An append ``check``: no other node committed ``epoch`` or a later one."""

        def check(size: int) -> None:
            assert self.follow is not None
            self.follow(size)
            if self._taken >= epoch:
                raise _Taken

        return check

    @property
    def current(self) -> bytes:
        """The current epoch's secret, for a draw recorded at once under the lock this shares
        with the validator (no epoch can end in between)."""
        return self._secret

    def draw(self, wait: bool = True) -> bytes | None:
        """The current epoch secret, held until :meth:`release`. While the epoch is changing
        this waits for the change, or with ``wait=False`` returns None at once: a caller that
        already holds the secret for another admission must not wait for itself."""
        with self._cv:
            while self._rolling:
                if not wait:
                    return None
                self._cv.wait()
            self._users += 1
            return self._secret

    def release(self, recorded: bool) -> None:
        """Count a recorded submission; end the epoch when due and nobody holds its secret."""
        with self._cv:
            self._users -= 1
            if recorded:
                self._submissions += 1
                if self._submissions >= self.cfg.audit.epoch_groups:
                    self._rolling = True
            if not self._rolling or self._users:
                return
            try:
                self.ledger.append(EpochRevealed(self.epoch, self._secret, self.clock()))
                self.state.mark_revealed(self.epoch)
                self._start_next()
            finally:
                self._rolling = False
                self._cv.notify_all()


class _Taken(Exception):
    """Another node committed the epoch number first (``EpochSecrets._start_next``)."""
