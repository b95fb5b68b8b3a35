"""``prooftrain calibrate``: measure honest noise and write a tolerance file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure honest generation-vs-recomputation noise and write a tolerance file",
        description="Generate honest rollouts in each generation precision, recompute them in the "
        "validator's precision with several batch sizes, groups packed and unpacked, and write the "
        "per-token and per-chunk thresholds (margin x the largest honest difference) for each "
        "generation precision, with the statistics behind them: a rollout is held to the bound of "
        "the precision its header declares. Point audit.tolerance_file at the result.",
    )
    p.add_argument("model_dir", type=Path, help="local Hugging Face model directory")
    p.add_argument("--out", type=Path, required=True, help="tolerance file to write (JSON)")
    p.add_argument("--task", default="arithmetic", help="task whose train prompts are used")
    p.add_argument("--prompts", type=int, default=32, help="number of prompts")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--generation-dtypes",
        default="float32,bfloat16",
        help="comma-separated precisions honest contributors may generate in",
    )
    p.add_argument("--recompute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--batch-sizes", default="1,4,16", help="comma-separated recomputation batch sizes"
    )
    p.add_argument(
        "--margin", type=float, default=2.0, help="threshold = margin x worst honest diff"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from node.validator.calibration import calibrate, write_tolerance_file
    from node.validator.policy import HFTextCodec
    from rewards.tasks.base import generate

    codec = HFTextCodec(args.model_dir)
    prompts = [
        codec.encode(p.prompt) for p in generate(args.task, "train", args.prompts, seed=args.seed)
    ]
    cal = calibrate(
        args.model_dir,
        prompts,
        stop_token_ids=[codec.eos_token_id] if codec.eos_token_id is not None else [],
        generation_dtypes=args.generation_dtypes.split(","),
        recompute_dtype=args.recompute_dtype,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        margin=args.margin,
        seed=args.seed,
        progress=True,
    )
    write_tolerance_file(cal, args.out)
    print(
        f"{'generation':>10} {'recompute':>9} {'batch':>5} {'layout':>8} {'tokens':>7} {'max|diff|':>10} "
        f"{'chunk mean':>10}"
    )
    for s in cal.settings:
        print(
            f"{s.generation_dtype:>10} {s.recompute_dtype:>9} {s.batch_size:>5} {s.layout:>8} {s.tokens:>7} "
            f"{s.token_max_abs:>10.3g} {s.chunk_mean_max:>10.3g}"
        )
    print(
        json.dumps(
            {
                "token_abs": cal.token_abs,
                "chunk_mean_abs": cal.chunk_mean_abs,
                "by_precision": {
                    d: {k: v[k] for k in ("token_abs", "chunk_mean_abs")}
                    for d, v in cal.by_precision().items()
                },
                "false_positive_rate_95ub": cal.false_positive_bound(),
                "out": str(args.out),
            }
        )
    )
    return 0
