"""``prooftrain trainer``: the asynchronous off-policy RL trainer.

Without ``--validator`` it trains against an in-process network
(``node.local``: a validator core and honest contributors); with ``--validator
URL --trainer-key FILE`` against a validator node over HTTP
(``node.remote_trainer``). Either way it prints the held-out eval
table before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from node.commands import model_dir_arg
from verify.errors import ConfigError

if TYPE_CHECKING:
    from node.local import LocalNetwork
    from trainer.config import TrainerConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trainer",
        help="train the policy on verified samples (async off-policy RL)",
        description="Train on the validator's accepted samples with importance-sampling "
        "correction and robust per-contributor gradient aggregation. Without --validator, "
        "runs against an in-process network and prints a before/after eval table.",
    )
    p.add_argument("--config", type=Path, help="trainer TOML (default: built-in defaults)")
    p.add_argument(
        "--validator",
        help="validator URL (remote mode; the node must trust "
        "--trainer-key; task, [rules] and the sampling temperature are read from it)",
    )
    p.add_argument("--trainer-key", type=Path, help="trainer signing key file (remote mode)")
    p.add_argument(
        "--model",
        type=model_dir_arg,
        help="base model directory (overrides model_dir; remote "
        "mode: the validator's policy.model_dir)",
    )
    p.add_argument("--steps", type=int, help="override the number of optimizer steps")
    p.add_argument("--checkpoint-dir", type=Path, help="override checkpoint_dir")
    p.add_argument("--resume", action="store_true", help="resume from checkpoint_dir/latest")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="stages > 1: let torchrun restart the stages N times after a failure "
        "(each restart resumes from the last checkpoint)",
    )
    p.add_argument("--metrics", type=Path, help="append metrics as JSON lines to this file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted, JSON value), e.g. --set lr=1e-4",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _run_remote(cfg: TrainerConfig, args: argparse.Namespace, stop: threading.Event) -> int:
    from node.client import ServiceError, ValidatorUnreachable, waited_out  # noqa: PLC0415
    from node.commands.keys import load_key_file  # noqa: PLC0415
    from node.remote_resume import DEFAULT_CHECKPOINT_DIR  # noqa: PLC0415
    from node.remote_trainer import run_remote  # noqa: PLC0415

    if args.trainer_key is None:
        raise ConfigError("--validator needs --trainer-key (the key the validator trusts)")
    key = load_key_file(args.trainer_key)
    if cfg.checkpoint_dir is None:
        cfg = cfg.model_copy(update={"checkpoint_dir": DEFAULT_CHECKPOINT_DIR})
    sink = open(args.metrics, "a") if args.metrics else None  # noqa: SIM115
    try:
        history = run_remote(
            cfg,
            args.validator,
            key,
            progress=not args.quiet,
            resume=args.resume,
            on_metrics=_metrics_writer(sink),
            stop=stop.is_set,
        )
    except (ServiceError, ValidatorUnreachable) as exc:
        if not (stop.is_set() and waited_out(exc)):  # a final answer fails, SIGTERM or not
            raise
        print(  # SIGTERM ended a wait for the validator (node.remote_trainer.waiting_out)
            f"trainer: stopped by SIGTERM while waiting for the validator ({exc}); the same "
            "command continues from the validator's policy version",
            file=sys.stderr,
            flush=True,
        )
        return 0
    finally:
        if sink is not None:
            sink.close()
    if history.stopped_at is not None:
        return _stopped(history.stopped_at, cfg, "the same command continues from there")
    print(eval_table(history.evals))
    return 0


def _stopped(version: int, cfg: TrainerConfig, how: str) -> int:
    saved = (
        f"checkpoint in {cfg.checkpoint_dir}: {how}"
        if cfg.checkpoint_dir is not None
        else "no checkpoint_dir, nothing saved"
    )
    print(
        f"trainer: stopped by SIGTERM at policy version {version}; {saved}",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _stop_on_sigterm() -> threading.Event:
    """An event SIGTERM sets: the loop checkpoints and returns. A second SIGTERM exits at once."""
    stop = threading.Event()

    def on_term(signum: int, _frame: object) -> None:
        if stop.is_set():
            print("trainer: second SIGTERM: exiting without a checkpoint", file=sys.stderr)
            raise SystemExit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    return stop


def _metrics_writer(sink):  # type: ignore[no-untyped-def]
    def on_metrics(version: int, metrics: dict) -> None:
        if sink is not None:
            sink.write(json.dumps({"version": version, **metrics}) + "\n")
            sink.flush()

    return on_metrics


def _overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    if args.steps is not None:
        out["steps"] = args.steps
    if args.checkpoint_dir is not None:
        out["checkpoint_dir"] = str(args.checkpoint_dir)
    if args.model is not None:
        out["model_dir"] = str(args.model)
    return out


def run(args: argparse.Namespace) -> int:
    stop = _stop_on_sigterm()  # first: a SIGTERM during start-up stops before the first step
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    from node.local import run_local  # noqa: PLC0415
    from rollout.loading import local_model_dir  # noqa: PLC0415
    from trainer.config import load_trainer_config  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    cfg = load_trainer_config(args.config, _overrides(args))
    if cfg.model_dir is not None:  # refused here, not in a stage under torchrun
        local_model_dir(cfg.model_dir, "model_dir")
    if args.validator:
        return _run_remote(cfg, args, stop)
    if cfg.stages > 1:  # torchrun's default handling: it stops the stages
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cfg.stages > 1 and "RANK" not in os.environ:
        from trainer.launch import run_torchrun  # noqa: PLC0415

        done = run_torchrun(
            "node.cli",
            cfg.stages,
            args=_forward(args),
            max_restarts=args.max_restarts,
            timeout_s=7 * 24 * 3600,
        )
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr[-4000:])
        return 0
    sink = open(args.metrics, "a") if args.metrics else None  # noqa: SIM115
    on_metrics = _metrics_writer(sink)

    # torchrun sets TORCHELASTIC_RESTART_COUNT > 0 when it restarted the stages after a failure.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if cfg.stages > 1:
        from node.local import run_local_pipeline  # noqa: PLC0415

        try:
            history = run_local_pipeline(
                cfg, progress=not args.quiet, on_metrics=on_metrics, resume=args.resume or restarted
            )
        finally:
            if sink is not None:
                sink.close()
        if history is not None:
            print(eval_table(history.evals))
        return 0
    network = _caught_up_network(cfg) if args.resume and cfg.checkpoint_dir else None
    try:
        history, net = run_local(
            cfg,
            network=network,
            progress=not args.quiet,
            on_metrics=on_metrics,
            resume=args.resume,
            stop=stop.is_set,
        )
    finally:
        if sink is not None:
            sink.close()
    if history.stopped_at is not None:
        net.close()
        return _stopped(history.stopped_at, cfg, "--resume continues from there")
    try:
        print(
            f"network: {dict(net.stats.verdicts)} audited={net.stats.audited} "
            f"admission_errors={dict(net.stats.admission_errors)}",
            file=sys.stderr,
        )
        print(eval_table(history.evals))
    finally:
        net.close()
    return 0


def _caught_up_network(cfg: TrainerConfig) -> LocalNetwork:
    """Open the in-process network under ``checkpoint_dir`` and bring the checkpoint up to
    the newest version its validator recorded.

    A kill after a publication and before the next checkpoint leaves the validator
    ahead of the checkpoint; the journaled steps in between are re-run, checked and
    saved (``TrainerLoop.resume(published=...)``), never published again.
    """
    import torch  # noqa: PLC0415

    from node.local import LocalNetwork, settings_from  # noqa: PLC0415
    from trainer.base_model import ensure_base_model  # noqa: PLC0415
    from trainer.loop import TrainerLoop, checkpoint_version, ensure_process_group  # noqa: PLC0415
    from trainer.pipeline import PipelineRunner  # noqa: PLC0415
    from trainer.stages import load_stage  # noqa: PLC0415

    assert cfg.checkpoint_dir is not None
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    net = LocalNetwork(model_dir, settings_from(cfg), work_dir=Path(cfg.checkpoint_dir) / "network")
    head = net.validator.versions.current
    if head > checkpoint_version(cfg.checkpoint_dir):
        torch.set_num_threads(cfg.threads)
        ensure_process_group()
        runner = PipelineRunner.for_config(load_stage(model_dir, 0, 1), cfg)
        loop = TrainerLoop(cfg, runner, net, weights=net.weights, progress=False)
        loop.resume(cfg.checkpoint_dir, published=head)
        loop.save(cfg.checkpoint_dir)
    return net


def _forward(args: argparse.Namespace) -> list[str]:
    """The same command line for each torchrun worker."""
    out = ["trainer"]
    for flag, value in (
        ("--config", args.config),
        ("--steps", args.steps),
        ("--model", args.model),
        ("--checkpoint-dir", args.checkpoint_dir),
        ("--metrics", args.metrics),
    ):
        if value is not None:
            out += [flag, str(value)]
    for item in args.set:
        out += ["--set", item]
    out += ["--resume"] * args.resume + ["--quiet"]
    return out


def eval_table(evals: dict) -> str:
    """Greedy held-out pass@1 per evaluated version, with 95% CIs."""
    rows = [("version", "pass@1 (greedy)", "95% CI", "n")]
    for version, report in sorted(evals.items()):
        m = report.metric("pass@1 (greedy)")
        rows.append(
            (str(version), f"{m.value:.4f}", f"[{m.ci_low:.4f}, {m.ci_high:.4f}]", str(m.n))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
