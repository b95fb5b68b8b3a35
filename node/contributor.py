"""The contributor process: ask for work, follow the policy, generate, sign, submit.

Loop:

1. Every group the state file lists as pending (generated, not yet
   acknowledged) is resubmitted as exactly those bytes, never regenerated: the
   validator answers an identical resubmission with the stored verdicts, so a
   restart never double-submits.
2. Otherwise ask for an assignment.
3. Make sure the assigned policy version is loaded: version 0 is the local
   base model; later versions are rebuilt from trainer-signed manifests and
   compressed deltas (``rollout.sync.PolicySync``), every signature and digest
   checked before anything is decoded.
4. Generate G completions with the verifiable sampler, commit and sign them,
   add the group to the state file's pending list, then submit it.
5. When its verdicts (or a final refusal) come back, remove it from the list.

Crash-safety invariant: a group is in the state file (written to a temporary
name, flushed, renamed over the old file) before any byte of it is submitted,
and leaves it only after the validator has answered it. The state directory is
locked while a process uses it (``node.contributor_state``).

With ``uploads`` = 1 each group is submitted and answered before the next
assignment is taken. With ``uploads`` = N > 1 submissions run on a pool of N
background threads while the main thread takes the next assignment and
generates; it blocks only while N groups are pending. Every state-file update
(main thread and submitters) holds one lock and rewrites the whole pending
list, so none is lost; statistics have their own lock. The
:class:`~node.client.ValidatorClient` is shared: it keeps no per-request state
and its ``httpx.Client`` connection pool is thread-safe. An exception raised by
a submitter reaches :meth:`Contributor.run` and ends it as if raised inline,
and ``run`` returns only once no submission is in flight.

Transient failures (connection errors, 429) are retried with exponential
backoff by the client; a group the validator is still too busy to take is sent
again after a pause, until it is answered (its assignment's expiry ends this);
a validator still unreachable after the client's retries (restarting, or a
link down) is tried again after a pause, for an assignment as for a group; a
refused submission is counted, reported and dropped; a refused key (unknown or
banned) stops the loop. Asking for work, any other 4xx answer (a policy
version or blob the validator cannot serve, a malformed request) is final:
``run`` raises it, naming the URL and the reason code, instead of taking more
assignments it cannot answer. Groups pending from an earlier run are said to be
resent, each as it goes. Setting ``stop`` (SIGTERM or SIGINT in
``prooftrain contributor``) ends it cleanly: no new assignment is taken, the
uploads in flight are answered, and ``run`` returns. An upload whose validator
cannot be reached once ``stop`` is set leaves its group pending in the state
directory, sent again on the next start.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from node.client import ServiceError, ValidatorClient, ValidatorUnreachable
from node.contributor_state import PendingFile, lock_state_dir
from node.validator.policy import HFTextCodec
from rollout.backends import loads_from_directory, make_backend
from rollout.sync import PolicySync, write_model_dir
from rollout.worker import answer, open_assignment
from verify.envelope import group_digest
from verify.errors import ConfigError, ProofTrainError, Reason
from verify.keys import PublicKey, SigningKey
from verify.signed import open_group_verdict
from verify.types import PolicyManifest, SignedManifest, Verdict, canonical_bytes, decode

# transformers' model loading is not thread-safe; contributors sharing a process load in turn.
_LOAD_LOCK = threading.Lock()
# A refused key ends the loop; every other refusal drops one group.
_STOP = (Reason.UNKNOWN_KEY, Reason.BANNED_KEY)


@dataclass
class ContributorStats:
    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class Contributor:
    def __init__(
        self,
        client: ValidatorClient,
        key: SigningKey,
        base_model_dir: Path,
        state_dir: Path,
        *,
        backend: str = "transformers",
        device: str | None = None,
        dtype: str | None = None,
        log: Callable[[str], None] = print,
        uploads: int = 1,
    ) -> None:
        if uploads < 1:
            raise ConfigError(f"uploads must be at least 1, got {uploads}")
        self.client, self.key, self.base = client, key, Path(base_model_dir)
        self.uploads = uploads
        lock_state_dir(Path(state_dir))  # one process per state directory
        self._pending_file = PendingFile(Path(state_dir), key.public)
        self.state_path = self._pending_file.path
        self._pending_file.read()  # a corrupt or foreign state file is reported before any work
        self.backend_name, self.device, self.dtype = backend, device, dtype
        self.codec = HFTextCodec(self.base)
        self.log = log
        self.stats = ContributorStats()
        self.stop = threading.Event()
        """Set (a SIGTERM or SIGINT does) to take no new assignment: :meth:`run` waits for the
        uploads in flight and returns; anything generated stays pending on disk."""
        self._state_lock = threading.Lock()  # every read-modify-write of the state file
        self._stats_lock = threading.Lock()  # stats and the refusal log line
        info = client.info()
        self.validator = PublicKey.from_hex(info["validator_key"])
        self.trainer = PublicKey.from_hex(info["trainer_key"]) if info.get("trainer_key") else None
        self._sync: Any = None
        self._version: int | None = None
        self._backend: Any = None

    # -- persistent state (``node.contributor_state``): the pending groups, oldest first
    def pending(self) -> list[dict[str, str]]:
        """Groups generated but not yet answered, oldest first."""
        return self._pending_file.read()

    def _save_pending(self, pending: list[dict[str, str]]) -> None:
        self._pending_file.write(pending)

    def _add_pending(self, entry: dict[str, str]) -> None:
        with self._state_lock:
            self._save_pending([*self.pending(), entry])

    def _drop_pending(self, group_hex: str) -> None:
        with self._state_lock:
            self._save_pending([p for p in self.pending() if p["group"] != group_hex])

    # -- policy
    def _backend_for(self, version: int) -> Any:
        if self._version == version and self._backend is not None:
            return self._backend
        with _LOAD_LOCK:
            return self._load_backend(version)

    def _load_backend(self, version: int) -> Any:
        if version == 0:
            model: Any = str(self.base)
        else:
            if self.trainer is None:
                raise ProofTrainError(
                    "the validator names no trainer key; cannot verify policy updates"
                )
            if self._sync is None:
                stages = len(decode_manifest(self.client.manifest(version)).shards)
                self._sync = PolicySync(
                    self.base, self.trainer, self.client.manifest, self.client.blob, stages
                )
            if loads_from_directory(self.backend_name):
                model = str(self._write_policy(version))
            else:
                model = self._sync.model_at(version)
        placement = (
            {} if self.device is None else {"device": self.device}
        )  # else the backend's default
        if self._backend is not None and hasattr(self._backend, "close"):
            self._backend.close()  # e.g. a vLLM engine's GPU memory, before the next one loads
            self._backend = None
        self._backend = make_backend(self.backend_name, model=model, dtype=self.dtype, **placement)
        self._version = version
        return self._backend

    def _write_policy(self, version: int) -> Path:
        """The rebuilt policy as a model directory (``rollout.sync.write_model_dir``),
        replacing the previous version's; written to a temporary name, then renamed."""
        root = self.state_path.parent / "policy"
        final, tmp = root / f"v{version}", root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_model_dir(tmp, self.base, self._sync.state_at(version))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in root.glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    # -- one group
    def _generate(self) -> bytes:
        """Take an assignment and answer it; the group is pending in the state file on return."""
        sealed = self.client.assign()
        a = open_assignment(sealed, self.validator, self.key.public)
        backend = self._backend_for(a.policy_version)
        group = canonical_bytes(answer(self.key, sealed, self.validator, backend, self.codec))
        self._add_pending({"assignment": canonical_bytes(sealed).hex(), "group": group.hex()})
        return group

    def _submit(self, raw: bytes, idle_s: float = 1.0) -> list[Verdict]:
        """Submit one pending group and drop it once answered. A busy validator (still
        busy after the client's retries: a 429, or a 5xx such as a node whose disk is
        full) and an unreachable one (still, after the client's retries) get the same
        bytes again after ``idle_s``, until it answers (the assignment's expiry bounds
        this) or ``stop`` is set: then :class:`LeftPending` is raised and the group stays
        pending, to be sent again on the next start. Sending them again is always safe: a
        group the validator recorded is answered from its record, never judged twice. A
        refusal is counted and returns no verdicts; a refused key is re-raised. Any other
        exception leaves the group pending, to be resubmitted after a restart."""
        cause: Exception
        while True:
            try:
                signed = self.client.submit(raw)
                break
            except ServiceError as exc:
                if not exc.busy:
                    return self._refused(raw, exc)
                why, cause = f"validator busy: {exc}", exc
            except httpx.TransportError as exc:  # still failing after the client's retries
                why, cause = _unreachable(exc), exc
            if not self.stop.is_set():
                self.log(f"{why}; sending the group again in {idle_s:g} s")
            if self.stop.is_set() or self.stop.wait(idle_s):
                self.log(
                    f"{why} while stopping: the group stays pending and is sent again "
                    "on the next start"
                )
                raise LeftPending from cause
        verdicts = open_group_verdict(signed, self.validator, group_digest(raw))
        self._drop_pending(raw.hex())
        with self._stats_lock:
            self.stats.submitted += 1
            for v in verdicts:
                if v.accepted:
                    self.stats.accepted += 1
                else:
                    self.stats.reject(v.reason)
        return verdicts

    def _refused(self, raw: bytes, exc: ServiceError) -> list[Verdict]:
        with self._stats_lock:
            self.stats.reject(exc.reason.value)
            self.log(f"submission refused: {exc}")
        self._drop_pending(raw.hex())
        if exc.reason in _STOP:
            raise exc
        return []

    def step(self) -> list[Verdict]:
        """One group, start to finish: the oldest pending group, else a new one."""
        pending = self.pending()
        if pending:
            raw = bytes.fromhex(pending[0]["group"])
            self._say_resend(raw, len(pending) - 1)
        else:
            raw = self._generate()
        return self._submit(raw)

    def _say_resend(self, raw: bytes, left: int) -> None:
        self.log(
            f"resending group {group_digest(raw).hex()[:16]}, generated before a restart and "
            f"never answered ({left} more pending); a group the validator judged gets the "
            "same verdicts back"
        )

    # -- the loop
    def run(self, groups: int | None = None, *, idle_s: float = 1.0) -> ContributorStats:
        """Answer ``groups`` groups (None: until the key is refused), pending ones first.

        Raises the ServiceError of a final (4xx, not 429) answer to a request for work,
        once the uploads in flight are answered.

        A group is done when its verdicts or a refusal arrive. At most
        ``uploads`` groups are pending at once, and none is in flight on return,
        whether ``run`` returns or raises.
        """
        backlog = [bytes.fromhex(p["group"]) for p in self.pending()]
        pool: Executor = (
            _Inline()
            if self.uploads == 1
            else ThreadPoolExecutor(self.uploads, thread_name_prefix="prooftrain-upload")
        )
        inflight: set[Future[list[Verdict]]] = set()
        answered: list[list[Verdict]] = []
        final: ServiceError | None = None
        try:
            while (groups is None or len(answered) < groups) and not self.stop.is_set():
                if len(inflight) >= self.uploads or (
                    groups is not None and len(answered) + len(inflight) >= groups
                ):
                    finished, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                    self._settle(finished, answered)
                    continue
                try:
                    if backlog:
                        raw = backlog.pop(0)
                        self._say_resend(raw, len(backlog))
                    else:
                        raw = self._generate()
                except ServiceError as exc:
                    if exc.reason in _STOP:
                        self.log(f"stopping: {exc}")
                        break
                    if not exc.busy:  # the validator's final answer: asking again changes nothing
                        final = exc
                        break
                    self.log(f"validator busy: {exc}; waiting {idle_s:.0f} s")
                    time.sleep(idle_s)
                    continue
                except httpx.TransportError as exc:  # still failing after the client's retries
                    self.log(f"{_unreachable(exc)}; asking again in {idle_s:g} s")
                    self.stop.wait(idle_s)
                    continue
                inflight.add(pool.submit(self._submit, raw, idle_s))
                finished = {f for f in inflight if f.done()}
                inflight -= finished
                self._settle(finished, answered)
        except ServiceError as exc:  # only a refused key leaves _submit
            self.log(f"stopping: {exc}")
        except BaseException:
            self._drain(pool, inflight, answered, reraise=False)
            raise
        self._drain(pool, inflight, answered, reraise=True)
        if final is not None:
            raise final
        return self.stats

    def _drain(
        self,
        pool: Executor,
        inflight: set[Future[list[Verdict]]],
        answered: list[list[Verdict]],
        *,
        reraise: bool,
    ) -> None:
        """Wait for the uploads already started and count them. A refused key is
        logged (the loop is stopping anyway); any other exception is logged and,
        if ``reraise``, the first is raised (else one is already propagating)."""
        wait(inflight)
        pool.shutdown()
        error: BaseException | None = None
        for f in inflight:
            try:
                self._settle([f], answered)
            except ServiceError as exc:
                self.log(f"stopping: {exc}")
            except BaseException as exc:
                self.log(f"upload failed: {exc!r}; the group stays pending")
                error = error or exc
        if error is not None and reraise:
            raise error

    def _settle(
        self, finished: Iterable[Future[list[Verdict]]], answered: list[list[Verdict]]
    ) -> None:
        """Log every finished upload's verdicts and append them to ``answered``;
        then raise the first failed upload's exception."""
        error: BaseException | None = None
        for f in finished:
            if isinstance(exc := f.exception(), LeftPending):
                continue  # not answered, and not a failure: it is sent again on the next start
            if exc is not None:
                error = error or exc
                continue
            verdicts = f.result()
            answered.append(verdicts)
            ok = sum(v.accepted for v in verdicts)
            self.log(
                f"group {len(answered)}: {ok}/{len(verdicts)} accepted"
                + (
                    f" ({', '.join(sorted({v.reason for v in verdicts if v.reason}))})"
                    if ok < len(verdicts)
                    else ""
                )
            )
        if error is not None:
            raise error


def _unreachable(exc: httpx.TransportError) -> str:
    """One line for a validator that did not answer; the client's own error names the URL."""
    return str(exc) if isinstance(exc, ValidatorUnreachable) else f"validator unreachable ({exc})"


class LeftPending(Exception):
    """An upload ended without an answer because the validator could not be reached, or
    was busy, once the contributor was stopping; its group stays pending in the state
    directory."""


class _Inline(Executor):
    """Runs each upload in the calling thread (``uploads`` = 1): one group at a time."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        f: Future[Any] = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            f.set_exception(exc)
        return f


def decode_manifest(sealed: SignedManifest) -> PolicyManifest:
    return decode(PolicyManifest, sealed.manifest, max_bytes=len(sealed.manifest))
