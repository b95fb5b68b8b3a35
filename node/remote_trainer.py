"""The trainer role against a validator node over HTTP (``prooftrain trainer --validator``).

The trainer holds the trainer key; the validator holds the ledger. Each step:

1. accepted samples come from ``GET /v1/samples`` by cursor (the trainer's
   buffer cursor is a ledger index, so a resumed trainer asks for exactly the
   samples it has not trained on);
2. after the optimizer step the new weights are published as a compressed
   delta: ``POST /v1/blobs`` for the blob, then ``POST /v1/policy`` for the
   signed manifest naming it (``trainer.publish.PublishHook``); contributors
   and the validator rebuild that version from the chain;
3. when an eval is due, the *published* copy (what contributors hold, not the
   trainer's float32 master weights) is evaluated on the held-out split and the
   signed :class:`verify.types.EvalStatement` goes to ``POST /v1/trainer/eval``,
   which records it in the ledger; a version the ledger already holds an eval
   of by this trainer key (``GET /v1/trainer/evals``, read at start: an earlier
   start that failed) is not evaluated again.

Where it starts: always at the validator's current version, from its own
checkpoint or, without one, from the chain of signed updates the validator
holds (``node.remote_resume``).

A validator that cannot answer for a while does not end the run: while it is
restarting (unreachable), busy (429) or out of disk (503 ``storage_full``) the
trainer sends the same request again every few seconds, up to ``patience_s``
apart, and says what it waits for and what would end the wait, once a minute
and whenever that changes (:func:`waiting_out`). A 429 or 503 recorded nothing,
and a publication sent again after a lost answer is not recorded twice
(``node.validator.trainer_side.publish_policy``), so the step in hand is
published once the validator takes it. ``stop()`` turning true ends the wait
with the validator's error; a restart then continues from the validator's
version.

One stage (S = 1) only: a pipeline job publishes from several processes and
needs rank 0 to gather their shard digests (``trainer.publish.gather_distributed``).
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from node.client import ServiceError, ValidatorClient, WaitOut
from node.remote_resume import continue_run, plan_start, rebuild_from_chain
from rollout.loading import load_pretrained_lm
from rollout.sync import base_model_digest
from trainer.base_model import ensure_base_model
from trainer.config import TrainerConfig
from trainer.evals import EvalReport, eval_statement, evaluate_heldout
from trainer.loop import History, TrainerLoop, ensure_process_group
from trainer.losses import Metrics
from trainer.pipeline import PipelineRunner
from trainer.publish import PublishHook, StagePublisher
from trainer.remote_network import adopt_network, check_base_model, describe, waiting_reporter
from trainer.stages import load_stage
from verify.errors import ConfigError, ProofTrainError, Reason
from verify.keys import SigningKey
from verify.manifest import manifest_digest
from verify.types import SampleBatch

MAX_FETCH = 4096
"""The most samples one ``/v1/samples`` request may ask for (``SampleBatch`` bound)."""


def waiting_out(
    stop: Callable[[], bool],
    patience_s: float = 30.0,
    log: Callable[[str], None] | None = None,
    every_s: float = 60.0,
) -> WaitOut:
    """The trainer's ``ValidatorClient.wait_out``: sleeps what the validator asked for (at
    most ``patience_s``), checking ``stop()`` twice a second, and logs what it waits for and
    what ends the wait at most once every ``every_s`` seconds, and whenever that changes.
    Returns False once ``stop()`` is true."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    told: list[Any] = [-float("inf"), None]  # when the operator was last told, and of what

    def wait(problem: ProofTrainError, seconds: float) -> bool:
        if stop():
            return False
        seconds = min(seconds, patience_s)
        now = time.monotonic()
        kind = (type(problem), getattr(problem, "status", None), getattr(problem, "reason", None))
        if now - told[0] >= every_s or kind != told[1]:
            told[:] = [now, kind]
            log(
                f"trainer: {problem}; {_remedy(problem)}. Asking again every {seconds:g} s "
                "(SIGTERM ends the wait; the same command continues from the validator's version)"
            )
        deadline = now + seconds
        while (left := deadline - time.monotonic()) > 0:
            if stop():
                return False
            time.sleep(min(0.5, left))
        return not stop()

    return wait


def _remedy(problem: ProofTrainError) -> str:
    """What ends a wait for the validator, in words for the operator."""
    if isinstance(problem, ServiceError) and problem.reason is Reason.STORAGE_FULL:
        return (
            "free space on the validator's disk (node.ledger, node.state_file, node.blob_dir); "
            "the trainer goes on by itself once it has"
        )
    if isinstance(problem, ServiceError):
        return "the validator is busy; the trainer goes on once it takes the request"
    return (
        "is the validator running, and reachable from here, at that address? The trainer goes "
        "on once it answers"
    )


class ClientSource:
    """``trainer.buffer.SampleSource`` over a validator's accepted-sample stream."""

    def __init__(self, client: ValidatorClient) -> None:
        self.client = client

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        return self.client.samples(cursor, min(limit, MAX_FETCH))


def run_remote(
    cfg: TrainerConfig,
    url: str,
    key: SigningKey,
    *,
    progress: bool = True,
    on_metrics: Callable[[int, Metrics], None] | None = None,
    resume: bool = False,
    poll_s: float = 0.5,
    stop: Callable[[], bool] | None = None,
    patience_s: float = 30.0,
) -> History:
    """Train against the validator at ``url`` with trainer key ``key``; returns the history.

    The validator must have been started with this trainer's public key. The
    run continues from the validator's policy version (``node.remote_resume``);
    ``resume`` (``--resume``) only makes a missing checkpoint worth a line.
    ``stop()`` turning true ends the run after a checkpoint (``TrainerLoop``), or ends a
    wait for a validator that cannot answer (see the module docstring; ``patience_s``: the
    longest wait between tries).
    """
    if cfg.stages != 1:
        raise ConfigError("remote mode trains a one-stage policy (stages = 1)")
    client = ValidatorClient(url, key, wait_out=waiting_out(stop or (lambda: False), patience_s))
    info = client.info()
    if info.get("trainer_key") != key.public.hex():
        raise ConfigError(
            f"the validator at {url} expects trainer key {info.get('trainer_key')} "
            f"(node.trainer_key), not this --trainer-key's {key.public.hex()}"
        )
    cfg = adopt_network(cfg, info, url)
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    check_base_model(model_dir, base_model_digest(model_dir), info, url)
    published = int(info["policy_version"])
    directory = None if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir)
    plan = plan_start(directory, published, asked=resume)
    if progress:
        print(describe(cfg, model_dir), flush=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    ensure_process_group()
    stage = load_stage(model_dir, 0, 1)
    p = cfg.publish
    publisher = StagePublisher.for_stage(stage, 0, p.codec, p.codec_params, p.snapshot_every)
    base_digest = base_model_digest(model_dir)
    hook = PublishHook(publisher, client, base_digest=base_digest, trainer_key=key)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = load_pretrained_lm(model_dir, dtype=torch.float32).eval()

    recorded = set(client.recorded_evals())  # by an earlier start of this run (one that failed)

    def evaluate_version(version: int) -> EvalReport | None:
        if version in recorded:  # recorded once per version, however often the trainer starts
            return None
        if hook.publisher.version != version:
            raise ConfigError(f"the published copy is at {hook.publisher.version}, not {version}")
        model = copy.deepcopy(template)
        hook.publisher.load_into(model)
        report = evaluate_heldout(model, tokenizer, cfg.task, cfg.eval_problems, cfg.seed)
        digest = manifest_digest(hook.parent) if version and hook.parent is not None else b""
        client.record_eval(
            eval_statement(
                report,
                version=version,
                manifest_digest=digest,
                task=cfg.task,
                split="heldout",
                seed=cfg.seed,
                key=key,
                created_at_ms=int(time.time() * 1000),
            )
        )
        recorded.add(version)
        return report

    runner = PipelineRunner.for_config(stage, cfg)
    loop = TrainerLoop(
        cfg,
        runner,
        ClientSource(client),
        publish=hook,
        evaluate=evaluate_version,
        on_metrics=on_metrics,
        stop=stop,
        progress=progress,
    )
    loop.wait = (
        waiting_reporter(loop.buffer, cfg, poll_s) if progress else (lambda: time.sleep(poll_s))
    )
    try:
        continue_run(
            plan,
            loop,
            hook,
            cfg,
            client,
            info.get("policy_index"),
            lambda v: rebuild_from_chain(
                client, v, template, base_digest, key.public, url, directory
            ),
        )
        if loop.version != published:
            raise ConfigError(
                f"the validator is at policy version {published} but the trainer "
                f"resumed at {loop.version}"
            )
        return loop.run()
    finally:
        client.close()
