"""``prooftrain calibrate``: measure honest noise and write a tolerance file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from node.commands import model_dir_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure honest generation-vs-recomputation noise and write a tolerance file",
        description="Generate honest rollouts in each generation precision, through the project's "
        "backend and plain transformers generate, recompute them in the validator's precision with "
        "several batch sizes, groups packed and unpacked, and write for each generation precision "
        "the per-token limits (margin x the largest honest difference, never below the built-in "
        "ones) and the divergence test's nulls (null margin x the mean honest difference and "
        "replay gap), with the statistics behind them: a rollout is held to the bounds and the "
        "test of the precision its header declares. Every setting must measure at least 2,000 "
        "tokens (else it says how many --prompts would). Point audit.tolerance_file at the result.",
    )
    p.add_argument("model_dir", type=model_dir_arg, help="local Hugging Face model directory")
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
    p.add_argument(
        "--null-margin",
        type=float,
        default=1.25,
        help="divergence nulls = null margin x the largest mean honest score of any setting",
    )
    p.add_argument(
        "--backends",
        default="transformers,transformers-generate",
        help="comma-separated honest generation paths to measure",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=2_000,
        help="fewest honest tokens per setting (a node refuses a file measured on fewer than "
        "its audit.min_calibration_tokens, 2,000 by default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from node.validator.calibration import calibrate, write_tolerance_file
    from node.validator.policy import HFTextCodec
    from rewards.tasks.base import generate
    from verify.divergence import DivergenceTest

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
        null_margin=args.null_margin,
        backends=args.backends.split(","),
        min_tokens=args.min_tokens,
        seed=args.seed,
        progress=True,
    )
    write_tolerance_file(cal, args.out)
    print(
        f"{'generation':>10} {'backend':>21} {'recompute':>9} {'batch':>5} {'layout':>8} "
        f"{'tokens':>7} {'max|diff|':>10} {'mean|diff|':>10} {'mean gap':>10}"
    )
    for s in cal.settings:
        print(
            f"{s.generation_dtype:>10} {s.backend:>21} {s.recompute_dtype:>9} {s.batch_size:>5} "
            f"{s.layout:>8} {s.tokens:>7} {s.token_max_abs:>10.3g} {s.token_mean_abs:>10.3g} "
            f"{s.replay_gap_mean:>10.3g}"
        )
    print(
        json.dumps(
            {
                "token_abs": cal.token_abs,
                "chunk_mean_abs": cal.chunk_mean_abs,
                "by_precision": {
                    d: {
                        k: v[k]
                        for k in (
                            "token_abs",
                            "chunk_mean_abs",
                            "replay_slack",
                            "logprob_scale",
                            "logprob_null",
                            "replay_null",
                        )
                    }
                    for d, v in cal.by_precision().items()
                },
                "false_alarm_bound": cal.false_positive_bound(),
                "false_alarm_horizon_tokens": DivergenceTest.__dataclass_fields__[
                    "horizon_tokens"
                ].default,
                "out": str(args.out),
            }
        )
    )
    return 0
