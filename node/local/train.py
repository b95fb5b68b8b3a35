"""Training against the in-process network (``node.local.network``).

``run_local`` trains a one-stage policy in this process; ``run_local_pipeline``
is one rank of an S-stage run under torchrun, with the network on rank 0 and
every rank fed the same batches (:class:`BroadcastSource`). Both evaluate
held-out greedy pass@1 at version 0, every ``eval_every`` steps and at the
end, and record each evaluation, signed, in the network's ledger.

Invariants:
- A network these functions open takes its settings from the trainer config
  alone (:func:`settings_from`) and, with a ``checkpoint_dir``, lives in its
  ``network/`` folder, so a resumed run reopens the same ledger.
- A resume continues the published chain only at the version the network's
  validator holds as current; every pipeline rank resumes to that version.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from node.local.network import LocalNetwork, LocalSettings
from trainer.base_model import ensure_base_model
from trainer.config import TrainerConfig
from trainer.evals import EvalReport, evaluate_heldout
from trainer.launch import init_distributed
from trainer.loop import History, TrainerLoop, ensure_process_group
from trainer.losses import Metrics
from trainer.pipeline import PipelineRunner
from trainer.stages import load_stage
from verify.errors import ConfigError
from verify.types import SampleBatch


def settings_from(cfg: TrainerConfig) -> LocalSettings:
    c = cfg.local
    return LocalSettings(
        contributors=c.contributors,
        group_size=c.group_size,
        max_tokens=c.max_tokens,
        temperature=c.temperature,
        pool=c.pool,
        task=cfg.task,
        seed=cfg.seed,
        rules=cfg.rules,
        groups_per_fetch=c.groups_per_fetch,
        codec=cfg.publish.codec,
        codec_params=tuple(sorted(cfg.publish.codec_params.items())),
        snapshot_every=cfg.publish.snapshot_every,
    )


def run_local(
    cfg: TrainerConfig,
    *,
    network: LocalNetwork | None = None,
    progress: bool = True,
    on_metrics: Callable[[int, Metrics], None] | None = None,
    resume: bool = False,
    stop: Callable[[], bool] | None = None,
) -> tuple[History, LocalNetwork]:
    """Train a one-stage policy against an in-process network; returns the history and network.

    Evaluates held-out greedy pass@1 at version 0, every ``eval_every`` steps and at the end.
    ``stop()`` turning true ends the run after a checkpoint (``TrainerLoop``). The caller
    closes the returned network.
    """
    if cfg.stages != 1:
        raise ConfigError("the in-process network trains a one-stage policy (stages = 1)")
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    ensure_process_group()
    work_dir = None if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir) / "network"
    net = network or LocalNetwork(model_dir, settings_from(cfg), work_dir=work_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def evaluate_version(version: int) -> EvalReport:
        report = evaluate_heldout(
            net.model(version), tokenizer, cfg.task, cfg.eval_problems, cfg.seed
        )
        net.record_eval(version, report, seed=cfg.seed)
        return report

    stage = load_stage(model_dir, 0, 1)
    runner = PipelineRunner.for_config(stage, cfg)
    loop = TrainerLoop(
        cfg,
        runner,
        net,
        publish=net.publish,
        evaluate=evaluate_version,
        weights=net.weights,
        on_metrics=on_metrics,
        stop=stop,
        progress=progress,
    )
    if (
        resume
        and cfg.checkpoint_dir is not None
        and loop.resume(cfg.checkpoint_dir, published=net.validator.versions.current)
    ):
        net.adopt(loop.version, stage)
    return loop.run(), net


class BroadcastSource:
    """Every rank gets the samples rank 0's network serves (pipeline ranks share batches)."""

    def __init__(self, inner: LocalNetwork | None) -> None:
        self.inner = inner

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        box = [self.inner.fetch(cursor, limit) if self.inner is not None else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0]


def run_local_pipeline(
    cfg: TrainerConfig,
    *,
    progress: bool = True,
    on_metrics: Callable[[int, Metrics], None] | None = None,
    resume: bool = False,
) -> History | None:
    """One rank of an S-stage run (under torchrun) against an in-process network on rank 0.

    Rank 0 hosts the network and evaluates; after each step the stages' tensors
    are gathered on rank 0 to register the new version with the in-process
    validator (a stand-in for per-stage weight publication). Returns the
    history on rank 0, None elsewhere.
    """
    rank, world = init_distributed()
    if world != cfg.stages:
        raise ConfigError(f"stages = {cfg.stages} but torchrun started {world} processes")
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work_dir = None if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir) / "network"
    net = LocalNetwork(model_dir, settings_from(cfg), work_dir=work_dir) if rank == 0 else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if rank == 0 else None

    def publish(version: int, stage: torch.nn.Module) -> None:
        own = {k: v for k, v in stage.state_dict().items() if "rotary" not in k}
        parts: list = [None] * world if rank == 0 else []
        dist.gather_object(own, parts if rank == 0 else None, dst=0)
        if net is not None:
            state = {k: v for part in parts for k, v in part.items()}
            if version < 0:
                net.adopt_state(-version, state)
            else:
                net.publish_state(version, state)

    def evaluate_version(version: int) -> EvalReport | None:
        if net is None:
            return None
        if tokenizer is None:  # rank 0 loads both the network and the tokenizer
            raise RuntimeError("rank 0 holds the network but no tokenizer")
        report = evaluate_heldout(
            net.model(version), tokenizer, cfg.task, cfg.eval_problems, cfg.seed
        )
        net.record_eval(version, report, seed=cfg.seed)
        return report

    runner = PipelineRunner.for_config(load_stage(model_dir, rank, world), cfg, rank, world)
    loop = TrainerLoop(
        cfg,
        runner,
        BroadcastSource(net),
        publish=publish,
        evaluate=evaluate_version,
        on_metrics=on_metrics if rank == 0 else None,
        progress=progress,
    )
    try:
        if resume and cfg.checkpoint_dir is not None:
            head = [net.validator.versions.current if net is not None else 0]
            dist.broadcast_object_list(head, src=0)  # every rank re-runs up to the same version
            if loop.resume(cfg.checkpoint_dir, published=head[0]):
                publish(-loop.version, runner.stage)  # negative: adopt, do not announce
        history = loop.run()
        if net is not None:
            print(
                f"network: {dict(net.stats.verdicts)} audited={net.stats.audited}", file=sys.stderr
            )
        return history if rank == 0 else None
    finally:
        if net is not None:
            net.close()
