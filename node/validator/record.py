"""Recording a judged group (phase C of admission in ``core``): verdicts, slashes, bodies.

For each member, in order (group-index order once the group is complete), the
ledger gets ``EpochVerdict`` (a ``VerdictRecorded`` with its audit draw's inputs and epoch) and, when its reason is in :data:`SLASHED`,
``Slashed`` right after it (evidence inline, or in the blob store when over
4 KiB). Each member also gets a ``Verdict``, and the group's verdicts are
signed once, together (``GroupVerdict``); accepted members get an
``AcceptedSample`` body.

Concurrent groups share one write (``node.validator.commit.GroupCommitter``):
one state transaction for the accepted bodies, one ledger transaction for the
records, then the stored answers for idempotent resubmission.

Invariants:
- Every record is checked (``check_record``) before the group is handed to
  the batch, so a bad record fails its own group, never the batch.
- Bodies are on disk before the ledger records commit (the ledger's
  transaction is written while they are fsync'd, and waits for them), so
  every accepted verdict in the ledger has its body; stored answers come
  last, so an answer always has its verdicts in the ledger. Once the ledger
  holds a group's verdicts the group is recorded: an answer that fails to
  store is kept in memory and stored with a later batch, never judged twice.
- :meth:`Recorder.record` returns only once the batch holding the group is
  durable in the ledger.
- A checkpoint (signed tree head) is requested with the batch that brings the
  count of groups since the last one to ``node.checkpoint_every``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ledger.log import Ledger
from ledger.records import (
    DivergenceRecorded,
    EpochVerdict,
    Record,
    Slashed,
    check_record,
    evidence_digest,
)
from node.config import ValidatorConfig
from node.validator.checks import Issued, Member
from node.validator.commit import GroupCommitter, Steps
from node.validator.state import State
from verify.envelope import completion_digest
from verify.errors import Reason
from verify.keys import SigningKey
from verify.signed import seal
from verify.types import (
    SCHEMA_VERSION,
    AcceptedSample,
    GroupVerdict,
    SignedGroupVerdict,
    Verdict,
    canonical_bytes,
)

SLASHED = frozenset(
    {
        Reason.WRONG_PROMPT,
        Reason.ASSIGNMENT_MISMATCH,
        Reason.STOPPING_RULE,
        Reason.LOGPROB_MISMATCH,
        Reason.TOKEN_OUTSIDE_SUPPORT,
        Reason.SAMPLER_REPLAY_MISMATCH,
        Reason.DIVERGENCE,
    }
)
"""Offences an honest contributor cannot commit, each proven by its evidence: slashed (and
banned). A copied completion is no offence of its own: it is always audited and fails the
sampler replay. DIVERGENCE is a sequential test whose calibrated false-alarm bound for an honest
contributor is ``false_alarm`` (1e-6 built in) over ``horizon_tokens`` audited tokens
(``verify.divergence``); its evidence is the ledger's ``DivergenceRecorded`` entries.
SAMPLING_DISTRIBUTION, a statistical test an honest contributor fails with probability
``audit.pit_alpha``, is a recorded failure against reputation instead."""
_U32 = np.dtype("<u4")
LOG = logging.getLogger("prooftrain.validator")


@dataclass(frozen=True)
class GroupWrite:
    """What one admitted group stores: ledger records, accepted bodies, the answer."""

    records: list[Record]
    samples: list[tuple[bytes, bytes]]  # (envelope digest, AcceptedSample bytes)
    completions: tuple[
        bytes, bytes, list[bytes]
    ]  # (prompt digest, assignment id, accepted completions)
    submission: tuple[
        bytes, bytes, bytes
    ]  # (assignment id, group digest, SignedGroupVerdict bytes)


class Recorder:
    """Seals verdicts and writes judged groups durably, several at a time."""

    def __init__(
        self,
        cfg: ValidatorConfig,
        key: SigningKey,
        ledger: Ledger,
        state: State,
        lock: threading.RLock,
        clock: Callable[[], int],
    ) -> None:
        self.cfg, self.key, self.ledger, self.state = cfg, key, ledger, state
        self.clock = clock
        self._lock = lock
        self._records_since_checkpoint = 0
        self.committer: GroupCommitter[GroupWrite] = GroupCommitter(self._write_batch)
        self._unstored: dict[bytes, tuple[bytes, bytes]] = {}
        """Answers whose verdicts the ledger holds but whose store failed, by assignment id:
        served from here and stored with the next batch."""
        self._unstored_lock = threading.Lock()

    def stored_answer(self, assignment_id: bytes) -> tuple[bytes, bytes] | None:
        """(group digest, answer) stored for an answered assignment, or None."""
        with self._unstored_lock:
            kept = self._unstored.get(assignment_id)
        return kept if kept is not None else self.state.submission(assignment_id)

    def record(
        self, issued: Issued, members: list[Member], group_digest: bytes, epoch: int
    ) -> Steps[SignedGroupVerdict]:
        """Build the verdicts and seal them together, then store them durably before
        returning them. ``epoch``: the audit epoch whose secret drew them.

        Steps: yields the group's ``GroupWrite`` and continues once it is durable
        (:meth:`write`)."""
        a = issued.wire
        now = self.clock()
        records: list[Record] = []
        samples: list[tuple[bytes, bytes]] = []
        completions: list[bytes] = []
        verdicts: list[Verdict] = []
        prompt_ids = np.asarray(issued.prompt_ids, _U32).tobytes()
        for m in members:
            h = m.rollout.header
            accepted = m.reason is None
            ev_digest = evidence_digest(m.evidence) if m.evidence else b""
            audited = m.audited or (m.reason in SLASHED) or m.reason is Reason.SAMPLING_DISTRIBUTION
            records.append(
                EpochVerdict(
                    a.contributor_key,
                    a.assignment_id,
                    h.group_index,
                    m.rollout.digest,
                    accepted,
                    "" if accepted else m.reason.value,  # type: ignore[union-attr]
                    audited,
                    ev_digest,
                    now,
                    b"" if m.discard else m.completion,
                    m.audit_rate,
                    m.forced,
                    epoch,
                )
            )
            if m.divergence is not None:
                records.append(divergence_record(a.contributor_key, m, now))
            if m.reason in SLASHED:
                records.append(slash_record(self.ledger, a.contributor_key, m, now))
            elif m.evidence and self.ledger.blobs is not None:
                self.ledger.blobs.put(m.evidence)  # the verdict names it by digest
            if accepted:
                samples.append((m.rollout.digest, canonical_bytes(accepted_sample(m, prompt_ids))))
                completions.append(m.completion or completion_digest(m.rollout))
            verdicts.append(
                Verdict(
                    SCHEMA_VERSION,
                    self.key.public.raw,
                    a.assignment_id,
                    h.group_index,
                    m.rollout.digest,
                    accepted,
                    "" if accepted else m.reason.value,  # type: ignore[union-attr]
                    m.reward,
                    m.audited,
                    ev_digest,
                    now,
                )
            )
        for rec in records:  # a bad record fails this group alone, not its whole batch
            check_record(rec)
        signed = seal(self.key, GroupVerdict(group_digest, verdicts))
        submission = (a.assignment_id, group_digest, canonical_bytes(signed))
        # Returns once durable in the ledger. Until then the group is in flight, so a
        # resubmission gets BACKPRESSURE, never a second judgement.
        yield GroupWrite(
            records, samples, (a.prompt_digest, a.assignment_id, completions), submission
        )
        return signed

    def write(self, writes: list[GroupWrite]) -> list[None]:
        """Store several groups durably: one transaction, shared with concurrent callers."""
        return self.committer.commit_many(writes)

    def _write_batch(self, batch: list[GroupWrite]) -> None:
        """Several groups at once: their accepted bodies in one state transaction, their
        verdicts and slashes in one ledger transaction, then their stored answers.

        Bodies go first: their index is committed and the ledger transaction written
        while the bodies are fsync'd, and that transaction commits only once they are on
        disk, so every accepted verdict in the ledger has its body. The answers go last,
        so a stored answer always has its verdicts in the ledger.
        """
        samples = [(w.submission[0], w.samples) for w in batch if w.samples]
        stored = None
        if samples:  # on disk while the ledger transaction is prepared; it commits after them
            stored = self.state.store_samples(samples, [w.completions for w in batch])
        self.ledger.append_many(
            [r for w in batch for r in w.records],
            checkpoint=self._checkpoint_due(len(batch)),
            before_commit=stored,
        )
        self._store_answers([w.submission for w in batch])

    def _store_answers(self, rows: list[tuple[bytes, bytes, bytes]]) -> None:
        """Store (assignment id, group digest, answer) rows whose verdicts the ledger now
        holds, with any an earlier batch failed to store. The groups are recorded whatever
        happens here: a failure (a full disk) is logged, never raised, and the answers stay
        in memory (:meth:`stored_answer`) until a later batch stores them, so a group sent
        again gets its answer instead of a second judgement."""
        with self._unstored_lock:
            self._unstored.update((aid, (digest, answer)) for aid, digest, answer in rows)
            pending = [(aid, digest, answer) for aid, (digest, answer) in self._unstored.items()]
        try:
            self.state.put_submissions(pending)
        except Exception as exc:  # noqa: BLE001 - the verdicts are durable; see the docstring
            LOG.error(
                "the ledger holds the verdicts of %d group(s) whose answers could not be "
                "stored (%s); they are kept in memory and stored with the next write",
                len(pending),
                exc,
            )
            return
        with self._unstored_lock:
            for aid, _, _ in pending:
                self._unstored.pop(aid, None)

    def _checkpoint_due(self, groups: int = 1) -> bool:
        with self._lock:
            self._records_since_checkpoint += groups
            if self._records_since_checkpoint >= self.cfg.node.checkpoint_every:
                self._records_since_checkpoint = 0
                return True
            return False


def slash_record(ledger: Ledger, contributor: bytes, m: Member, now: int) -> Slashed:
    """The ``Slashed`` record for a failed member; evidence over 4 KiB goes to the blob store."""
    digest = evidence_digest(m.evidence)
    inline = m.evidence
    if len(inline) > 4096 and ledger.blobs is not None:
        ledger.blobs.put(inline)
        inline = b""
    return Slashed(
        contributor,
        m.reason.value,  # type: ignore[union-attr]
        f"group member {m.rollout.header.group_index}",
        digest,
        inline,
        now,
    )


def accepted_sample(m: Member, prompt_ids: bytes) -> AcceptedSample:
    """The stored body of an accepted member (``ledger_index`` is filled in when served)."""
    h = m.rollout.header
    return AcceptedSample(
        ledger_index=0,
        envelope_digest=m.rollout.digest,
        contributor_key=h.contributor_key,
        assignment_id=h.assignment_id,
        group_index=h.group_index,
        group_size=h.group_size,
        policy_version=h.policy_version,
        task_id=h.task_id,
        prompt_id=h.prompt_id,
        prompt_ids=prompt_ids,
        token_ids=m.envelope.body.token_ids,
        logprobs=m.envelope.body.logprobs,  # the arrays' bytes
        temperature=h.sampling.temperature,
        top_k=h.sampling.top_k,
        top_p=h.sampling.top_p,
        reward=m.reward,
        audited=m.audited,
    )


def divergence_record(contributor: bytes, m: Member, now: int) -> DivergenceRecorded:
    """What ``m`` added to its contributor's divergence detector (``m.divergence`` is set)."""
    evidence, test, seq = m.divergence  # type: ignore[misc]
    return DivergenceRecorded(
        contributor,
        m.rollout.digest,
        m.rollout.header.precision,
        seq,
        test.digest(),
        test.threshold,
        evidence.tokens,
        evidence.logprob_sum,
        evidence.replayed,
        evidence.replay_sum,
        [float(v) for v in evidence.increments.ravel()],
        now,
    )
