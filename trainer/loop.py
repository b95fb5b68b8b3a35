"""The trainer loop: versions, async/sync ingestion, evals, checkpoints, resume.

Version v is the policy after v optimizer steps (v = 0 is the base model).
Each step: take ``batch_groups`` complete groups from the buffer (dropping
what is staler than ``max_staleness``, or anything not of version v in sync
mode), build the batch, run one ``RLStep``, bump the version, call the
``publish`` hook with ``(version, stage)``, then evaluate and checkpoint when due.

Checkpoint invariants: one file per stage, written to a temporary name and
renamed (a crash leaves the previous checkpoint intact); it holds the stage's
parameters and optimizer state, the version, the buffer state (cursor and the
samples it holds), the RNG states and the publish hook's state. Resuming from
it trains every served sample exactly once (or drops it as stale) and never
skips one. ``latest`` names the newest complete checkpoint and is written
(atomically) by rank 0 after every rank saved its file.

Crash consistency: each step is written to the step journal
(``trainer.journal``) before it is published, so a kill between a
publication and the next checkpoint leaves the journal ahead of the
checkpoint. ``resume(directory, published=v)`` then re-runs the journaled
steps up to ``v`` without publishing them, each checked against its journal
line (same samples, same aggregation weights, same resulting parameters), and
steps past ``v`` are re-run, checked and published by ``run``. No version is
published twice and no sample is trained twice or skipped.

Stopping: when ``stop()`` turns true (a SIGTERM handler sets it) the loop
finishes the step in progress, or abandons the wait for samples (the groups
taken so far go back to the buffer), writes a checkpoint of the last completed
step and returns with ``History.stopped_at`` set.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from rollout.progress import progress as progress_bar
from trainer.allocator import retain_freed_memory
from trainer.batch import build_batch
from trainer.buffer import SampleBuffer, SampleSource
from trainer.config import TrainerConfig
from trainer.evals import EvalReport
from trainer.journal import StepJournal, StepRecord, journal_path, params_digest
from trainer.losses import Metrics, get_policy_loss
from trainer.pipeline import PipelineRunner
from trainer.rl import RLStep, lr_multiplier
from trainer.stages import Stage
from verify.aggregate import get_aggregator
from verify.errors import ProofTrainError

Publish = Callable[[int, Stage], object]
"""Called after every optimizer step with the new version and this rank's stage; its result
is ignored."""
Evaluate = Callable[[int], EvalReport | None]
"""Evaluate policy ``version``; None on ranks that do not evaluate."""
Weights = Callable[[tuple[bytes, ...]], torch.Tensor]
"""Contributor keys -> aggregation weights (n,)."""


class Stateful(Protocol):
    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


@dataclass
class History:
    """What a run produced: metrics per step and eval reports per version."""

    metrics: list[Metrics] = field(default_factory=list)
    evals: dict[int, EvalReport] = field(default_factory=dict)
    stopped_at: int | None = None
    """The version the loop stopped at when ``stop()`` ended it early."""


class Stopped(ProofTrainError):
    """Raised from the wait for samples when the loop was asked to stop."""


def staleness_metrics(hist: dict[int, int]) -> Metrics:
    total = sum(hist.values())
    out: Metrics = {f"off_policy/staleness/{s}": float(n) for s, n in sorted(hist.items())}
    if total:
        out["off_policy/staleness_mean"] = sum(s * n for s, n in hist.items()) / total
        out["off_policy/staleness_max"] = float(max(hist))
    return out


class TrainerLoop:
    """One rank's loop. Every rank builds one with the same config and source."""

    def __init__(
        self,
        cfg: TrainerConfig,
        runner: PipelineRunner,
        source: SampleSource,
        *,
        publish: Publish | None = None,
        evaluate: Evaluate | None = None,
        weights: Weights | None = None,
        on_metrics: Callable[[int, Metrics], None] | None = None,
        wait: Callable[[], None] | None = None,
        stop: Callable[[], bool] | None = None,
        progress: bool = True,
    ) -> None:
        retain_freed_memory()  # every step allocates the same buffers: keep their pages
        self.cfg = cfg
        self.runner = runner
        self.stage = runner.stage
        self.publish, self.evaluate, self.weights = publish, evaluate, weights
        self.on_metrics, self.wait, self.progress = on_metrics, wait, progress
        self.stop = stop
        self.optimizer = torch.optim.AdamW(
            [p for p in self.stage.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        loss = get_policy_loss(cfg.loss.name, **cfg.loss.params)
        self.step_fn = RLStep(
            runner,
            self.optimizer,
            loss,
            get_aggregator(cfg.aggregator.name, **cfg.aggregator.params),
            grad_clip=cfg.grad_clip,
            importance_sampling=cfg.loss.importance_sampling,
            proximal=cfg.loss.name == "ppo-decoupled",
            gram_sketch=cfg.aggregator.gram_sketch,
            keep_bytes=int(cfg.aggregator.keep_gib * 2**30),
        )
        self.buffer = SampleBuffer(
            source,
            max_staleness=cfg.rules.max_staleness,
            capacity=cfg.buffer_capacity,
            skip_uniform=cfg.skip_uniform_groups,
            sync=cfg.mode == "sync",
        )
        self.version = 0
        self.history = History()
        self.journal = (
            None
            if cfg.checkpoint_dir is None
            else StepJournal(journal_path(cfg.checkpoint_dir, runner.rank))
        )
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    # -- one step

    def train_step(self) -> Metrics:
        t0 = time.monotonic()
        taken = self.buffer.fill(
            self.cfg.batch_groups,
            self.version,
            wait=self._wait,
            timeout_s=self.cfg.starve_timeout_s,
        )
        t1 = time.monotonic()
        batch = build_batch(
            taken.groups,
            self.version,
            temperature=self.runner.temperature,
            pad_id=0,
            normalize_std=self.cfg.loss.normalize_std,
        )
        use_weights = self.cfg.aggregator.reputation_weights and self.weights is not None
        w = self.weights(batch.contributors) if use_weights else None  # type: ignore[misc]
        done = self.journal.get(self.version + 1) if self.journal is not None else None
        if done is not None and done.weights is not None:  # a re-run uses the weights it had
            w = torch.tensor(done.weights, dtype=torch.float64)
        self._set_lr()
        metrics = self.step_fn(batch, w)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        self.version += 1
        if self.journal is not None:
            self.journal.record(
                StepRecord(
                    self.version,
                    self.buffer.cursor,
                    tuple(s.ledger_index for g in taken.groups for s in g),
                    tuple(taken.dropped),
                    None if w is None else tuple(float(x) for x in w),
                    params_digest(self.stage),
                )
            )
        if self.publish is not None:
            self.publish(self.version, self.stage)
        metrics.update(staleness_metrics(dict(taken.staleness)))
        metrics.update(
            {
                "train/reward": float(batch.rewards.mean()),
                "train/length": float(batch.lengths.float().mean()),
                "train/samples": float(batch.size),
                "train/version": float(self.version),
                "off_policy/stale_dropped": float(taken.stale_dropped),
                "off_policy/uniform_dropped": float(taken.uniform_dropped),
                "perf/wait_s": t1 - t0,
                "perf/step_s": time.monotonic() - t1,
            }
        )
        return metrics

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop()

    def _wait(self) -> None:
        if self._stopping():
            raise Stopped(f"stopped while waiting for samples for version {self.version + 1}")
        (self.wait or (lambda: time.sleep(0.2)))()

    def _set_lr(self) -> None:
        """The scheduled learning rate of step ``version`` (pure in the version: resumable)."""
        lr = self.cfg.lr * lr_multiplier(
            self.cfg.lr_schedule,
            self.version,
            self.cfg.steps,
            warmup=self.cfg.warmup_steps,
            min_ratio=self.cfg.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def run(self, steps: int | None = None) -> History:
        """Train until version ``cfg.steps`` (or ``steps`` more steps)."""
        target = self.cfg.steps if steps is None else self.version + steps
        rank0 = self.runner.rank == 0
        if self.version == 0 and self._due(self.cfg.eval_every, start=True):
            self._eval()
        bar = progress_bar(
            target, "train", "step", enabled=self.progress and rank0, initial=self.version
        )
        while self.version < target:
            try:
                if self._stopping():
                    raise Stopped(f"stopped at version {self.version}")
                metrics = self.train_step()
            except Stopped:
                self.history.stopped_at = self.version
                if self.cfg.checkpoint_dir is not None:
                    self.save(self.cfg.checkpoint_dir)
                break
            self.history.metrics.append(metrics)
            if self.on_metrics is not None:
                self.on_metrics(self.version, metrics)
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['train/reward']:.3f}",
                loss=f"{metrics.get('train/loss', 0.0):.3f}",
            )
            if self._due(self.cfg.eval_every) or (self.version == target and self.cfg.eval_every):
                self._eval()
            if self.cfg.checkpoint_dir is not None and (
                self.version % self.cfg.checkpoint_every == 0 or self.version == target
            ):
                self.save(self.cfg.checkpoint_dir)
        bar.close()
        return self.history

    def _due(self, every: int, start: bool = False) -> bool:
        return every > 0 and (start or self.version % every == 0)

    def _eval(self) -> None:
        if self.evaluate is None or self.version in self.history.evals:
            return
        report = self.evaluate(self.version)
        if report is not None:
            self.history.evals[self.version] = report
            if self.on_metrics is not None:
                m = report.metric("pass@1 (greedy)")
                self.on_metrics(
                    self.version,
                    {
                        "eval/pass@1": m.value,
                        "eval/pass@1_low": m.ci_low,
                        "eval/pass@1_high": m.ci_high,
                    },
                )

    # -- checkpoints

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": self.version,
            "stage": self.stage.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "buffer": self.buffer.state(),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
        }
        if self.publish is not None and hasattr(self.publish, "state"):
            state["publish"] = self.publish.state()  # type: ignore[attr-defined]
        return state

    def save(self, directory: Path) -> Path:
        """Write this rank's checkpoint for the current version; return its folder."""
        folder = Path(directory) / f"v{self.version:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"stage{self.runner.rank}.pt"
        _atomic_write(target, lambda f: torch.save(self._state(), f))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if self.runner.rank == 0:
            _atomic_write(Path(directory) / "latest", lambda f: f.write(folder.name.encode()))
        return folder

    def resume(self, directory: Path, published: int | None = None) -> bool:
        """Load the newest checkpoint under ``directory``; False when there is none.

        ``published``: the newest version the validator holds. When it is past the
        checkpoint, the journaled steps up to it are re-run (not published) from
        the checkpoint, or from the start when there is none (see the module docstring).
        """
        loaded = self._load(directory)
        if published is not None and published > self.version:
            self.replay_published(published)
            return True
        return loaded

    def replay_published(self, target: int) -> None:
        """Re-run the journaled steps up to ``target`` without publishing them (see the
        module docstring); the publish hook stays where the checkpoint left it."""
        publish, self.publish = self.publish, None
        try:
            while self.version < target:
                if self.journal is None or self.journal.get(self.version + 1) is None:
                    raise ProofTrainError(
                        f"version {self.version + 1} was published but the step journal has "
                        "no record of it; cannot re-run it"
                    )
                self.train_step()
        finally:
            self.publish = publish

    def _load(self, directory: Path) -> bool:
        pointer = Path(directory) / "latest"
        if not pointer.is_file():
            return False
        path = Path(directory) / pointer.read_text().strip() / f"stage{self.runner.rank}.pt"
        # Our own checkpoint file (written by ``save``); it holds Python RNG state.
        state = torch.load(path, weights_only=False)
        self.stage.load_state_dict(state["stage"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.buffer.load_state(state["buffer"])
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        if "publish" in state and self.publish is not None and hasattr(self.publish, "load_state"):
            self.publish.load_state(state["publish"])  # type: ignore[attr-defined]
        return True


def checkpoint_version(directory: Path) -> int:
    """The version of the newest complete checkpoint under ``directory`` (0 when none)."""
    pointer = Path(directory) / "latest"
    return int(pointer.read_text().strip().removeprefix("v")) if pointer.is_file() else 0


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def ensure_process_group() -> None:
    """A one-process gloo group for S = 1 runs outside torchrun (no-op when one exists)."""
    if dist.is_initialized():
        return
    from trainer.launch import LOCALHOST, free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://{LOCALHOST}:{free_port()}", rank=0, world_size=1
    )
