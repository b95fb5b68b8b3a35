"""A run's held-out evals in a process of their own, while the run trains on.

The scenario run of ``make demo`` evaluates every version it publishes
(``trainer.eval_every_version``): a greedy pass over 1000 held-out problems
takes about 0.6 s on the demo model, as long as a training step, and done
in-line it doubled the run's wall time while the machine's other core sat
idle. :class:`BackgroundEvals` hands each version's weights to one worker
process (``spawn``: no forked locks or threads) that holds its own copy of
the policy, the tokenizer and the held-out problems, and gives back each
:class:`~trainer.evals.EvalReport` for the run to record on its own thread,
so the ledger and the event log keep one writer. A worker process, not a
thread: the run measures its own compute to drive the simulated clock, and
a thread would share the interpreter lock with it and slow what it measures.

The reports are the ones an in-line eval gives: the same weights (the
state dict, copied exactly), the same problems and generation length, one
torch thread.

Invariants:
- Reports come back in the order their versions were submitted.
- At most ``max_pending`` versions are in flight; :meth:`submit` waits for the
  oldest report beyond that (and keeps it for :meth:`ready`), so a slow
  machine never queues weights without bound.
- Every report is handed out exactly once, by :meth:`ready` or :meth:`drain`.
- An eval that fails in the worker raises :class:`EvalWorkerError` (with the
  worker's traceback) in the caller, at the next call that collects reports; a
  worker that dies raises it too. :meth:`close` stops the worker in every case.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rewards.base import Problem
from trainer.evals import EvalReport

__all__ = ["BackgroundEvals", "Evaluated", "EvalWorkerError"]


class EvalWorkerError(RuntimeError):
    """The eval worker failed an eval or exited."""


@dataclass(frozen=True)
class Evaluated:
    """One version's report, with what the caller attached to it at submission."""

    version: int
    report: EvalReport
    tag: Any


class BackgroundEvals:
    """Greedy held-out evals of policy versions in one worker process.

    ``model_dir`` is the run's base model (the worker builds the architecture
    from it once and loads each version's state dict into it); the worker
    evaluates ``problems`` of ``task`` with ``max_new_tokens`` and ``seed`` as
    :func:`trainer.evals.evaluate` does (``k=1``: greedy pass@1 and mean reward).
    Use it as a context manager, or :meth:`close` it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        task: str,
        problems: Sequence[Problem],
        *,
        max_new_tokens: int,
        seed: int,
        max_pending: int = 2,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.max_pending = max_pending
        self._pending: deque[tuple[int, Any]] = deque()
        self._done: list[Evaluated] = []
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._proc = context.Process(
            target=_serve,
            args=(theirs, str(model_dir), task, list(problems), max_new_tokens, seed),
            name="prooftrain-evals",
            daemon=True,
        )
        self._proc.start()
        theirs.close()

    def __enter__(self) -> BackgroundEvals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pending(self) -> int:
        """Versions submitted and not yet reported."""
        return len(self._pending)

    def submit(self, version: int, model: torch.nn.Module, tag: Any = None) -> None:
        """Evaluate ``model`` as policy ``version`` (its weights are serialized now, so the
        caller may drop or change the model afterwards); ``tag`` comes back with its report.

        While more than ``max_pending`` are in flight it waits for the oldest reports."""
        state = {k: t.cpu() for k, t in model.state_dict().items()}  # detached already
        self._send(pickle.dumps((version, state), pickle.HIGHEST_PROTOCOL))
        self._pending.append((version, tag))
        while len(self._pending) > self.max_pending:
            self._done.append(self._receive())

    def ready(self) -> list[Evaluated]:
        """The reports in and not yet handed out, oldest first, without waiting."""
        while self._pending and self._poll():
            self._done.append(self._receive())
        done, self._done = self._done, []
        return done

    def drain(self) -> list[Evaluated]:
        """Every report not yet handed out, oldest first, waiting for those still in flight."""
        while self._pending:
            self._done.append(self._receive())
        return self.ready()

    def close(self) -> None:
        """Stop the worker (outstanding evals are dropped; :meth:`drain` first to keep them)."""
        try:
            self._conn.send_bytes(b"")
        except (OSError, ValueError):
            pass
        self._conn.close()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _send(self, message: bytes) -> None:
        try:
            self._conn.send_bytes(message)
        except OSError as exc:
            raise self._gone() from exc

    def _poll(self) -> bool:
        try:
            return self._conn.poll()
        except OSError as exc:
            raise self._gone() from exc

    def _receive(self) -> Evaluated:
        version, tag = self._pending[0]
        try:
            answer = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._gone() from exc
        self._pending.popleft()
        got, report, error = answer
        if error is not None:
            raise EvalWorkerError(
                f"the eval of policy version {version} failed in the eval worker:\n{error}"
            )
        if got != version:
            raise EvalWorkerError(f"the eval worker answered version {got} for version {version}")
        return Evaluated(version, report, tag)

    def _gone(self) -> EvalWorkerError:
        self._proc.join(1)
        code = self._proc.exitcode
        return EvalWorkerError(
            "the eval worker exited" + (f" with code {code}" if code is not None else "")
        )


def _serve(
    conn: Any, model_dir: str, task: str, problems: list[Problem], max_new_tokens: int, seed: int
) -> None:
    """The worker: load the architecture once, then evaluate each version sent until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle: it stops us
    torch.set_num_threads(1)  # as the run does: one core, and the same kernels' rounding
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rollout.loading import load_pretrained_lm
    from trainer.evals import evaluate

    hf_logging.disable_progress_bar()  # the run's own progress bar is the one to read

    # As the run loads them (``node.local.network``, ``harness.run``).
    model = load_pretrained_lm(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        version, state = pickle.loads(message)
        answer: tuple[int, EvalReport | None, str | None]
        try:
            model.load_state_dict(state)
            report = evaluate(
                (model, tokenizer),
                task,
                "heldout",
                k=1,
                samples=1,
                seed=seed,
                problems=problems,
                max_new_tokens=max_new_tokens,
            )
            answer = (version, report, None)
        except Exception:  # noqa: BLE001 - handed to the run, which raises it with this text
            answer = (version, None, traceback.format_exc())
        try:
            conn.send_bytes(pickle.dumps(answer, pickle.HIGHEST_PROTOCOL))
        except OSError:  # the run went away
            return
