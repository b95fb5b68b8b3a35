"""``prooftrain eval``: pass@1, pass@k, mean reward and length of a model on a task."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from node.commands import model_dir_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a model directory on a task split",
        description="Report pass@1 (greedy), pass@k (sampled, unbiased estimator), mean reward "
        "and mean length with 95% confidence intervals, for any Hugging Face model "
        "directory (base models and trainer checkpoints alike).",
    )
    p.add_argument("model_dir", type=model_dir_arg, help="directory saved with save_pretrained")
    p.add_argument("--task", default="arithmetic", help="synthetic task (default: arithmetic)")
    p.add_argument(
        "--split",
        default="heldout",
        choices=("train", "heldout", "originals"),
        help="default: heldout; `originals` (gsm8k): the 100 original GSM8K test problems, which "
        "compare with published figures for a base model",
    )
    p.add_argument("--data", help="JSONL problem file to use instead of generated problems")
    p.add_argument("-n", "--num-problems", type=int, default=200, help="problems (default: 200)")
    p.add_argument("-k", type=int, default=8, help="k of pass@k (default: 8)")
    p.add_argument("--samples", type=int, help="samples per problem for pass@k (default: k)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)"
    )
    p.add_argument("--seed", type=int, default=0, help="problem and sampling seed (default: 0)")
    p.add_argument(
        "--max-new-tokens", type=int, help="default: from the task's answers, 256 for files"
    )
    p.add_argument("--batch-size", type=int, default=64, help="default: 64")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    from rewards.tasks import generate as generate_problems  # noqa: PLC0415
    from rewards.tasks import load_jsonl  # noqa: PLC0415
    from rollout.progress import progress  # noqa: PLC0415
    from trainer.evals import eval_completions, evaluate, load_policy, report_json  # noqa: PLC0415

    hf_logging.disable_progress_bar()  # keep the output to our own table and bar
    split = args.split
    if args.data:
        problems = load_jsonl(args.data, limit=args.num_problems)
        split = Path(args.data).name
    elif args.split == "originals":
        problems = originals(args.task)[: args.num_problems]
    else:
        problems = generate_problems(args.task, split, args.num_problems, args.seed)
    policy, tokenizer = load_policy(args.model_dir, args.device)
    total = eval_completions(len(problems), args.k, args.samples)
    with progress(total, "evaluating", "completions") as bar:
        report = evaluate(
            (policy, tokenizer),
            args.task,
            "heldout" if split == "originals" else split,
            k=args.k,
            samples=args.samples,
            temperature=args.temperature,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            problems=problems,
            progress=bar.update,
        )
    report = dataclasses.replace(report, model=str(args.model_dir), split=split)
    print(report_json(report) if args.json else report.to_table())
    return 0


def originals(task: str) -> list:
    """The original problems a task's variants were made from (gsm8k), for ``--split originals``."""
    from rewards.tasks import get_task  # noqa: PLC0415
    from verify.errors import ConfigError  # noqa: PLC0415

    fn = getattr(get_task(task), "originals", None)
    if fn is None:
        raise ConfigError(f"task {task!r} has no original problems; --split originals is for gsm8k")
    return list(fn())
