"""Per-contributor gradients: one pass for the whole batch against one pass per contributor,
and against no per-contributor gradients at all.

Robust aggregation needs one gradient per contributor. ``trainer.rl.RLStep``
computes them from one forward and backward pass over the whole batch
(``trainer.groupgrad``), with the contributors' Gram matrix exact or, in the
``one_pass_sketch`` mode, estimated from a random sketch
(``aggregator.gram_sketch``); two baselines run in the same process, rounds
alternating: the pass per contributor it falls back to, and the trust-off
trainer step (``bench._trust_off.PlainStep``: one forward and backward of the
whole batch under the same loss, a plain mean gradient, no aggregation), which
``bench/trust_overhead.py`` uses as its trust-off side. Each runs the full RL
step (loss, aggregation or mean, optimizer step) on one torch thread, on
batches shaped like ``bench/trust_overhead.py``'s: ``--rows`` completions per
contributor, ``--prompt`` + ``--completion`` tokens. The model is the demo base
model, a random-init Llama of ``--width`` x ``--layers`` (384 x 6 is the 14M
size of ``trust_overhead.py --scaling``), or ``--model-dir``.

Prints progress on stderr and one JSON object on the last line of stdout:

  by_contributors      for each contributor count: each mode's step time (ms, best of
                       --rounds alternating rounds), the one-pass speedup over a pass
                       per contributor, and trainer_trust_ratio
  speedup              per-contributor / one-pass time at --contributors (default 8)
  trainer_trust_ratio  plain-mean / one-pass time at --contributors: the trainer side of
                       bench/trust_overhead.py's trust_ratio (steps per second with
                       per-contributor gradients and centered-clip over steps per second
                       with one mean gradient), with nothing else of the trust layer in it
  keep_gib             the one pass's budget for per-contributor rows kept between its
                       Gram matrix and its combine (--keep-gib; rows beyond it are
                       formed twice)
  sketch_trainer_trust_ratio  the same with the one pass's Gram matrix estimated from a
                       --sketch x --sketch sketch per weight matrix (aggregator.gram_sketch)
  *_page_faults        each mode's minor page faults in a timed step (median)
  freed_memory_kept    whether freed memory stays in the process, as in the trainer loop
                       (False with --default-allocator or without glibc)
  max_update_diff      largest |difference| between the one-pass and per-contributor
                       parameter updates after one SGD step from the same weights
                       (float rounding only)

    python bench/contributor_grads.py [--contributors 8] [--rows 8] [--rounds 9] [--sketch 64]
                                      [--keep-gib 1.0] [--default-allocator]
                                      [--counts 2,8,16] [--width 384 --layers 6 | --model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from rollout.loading import model_dir_arg  # noqa: E402


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_batch(contributors: int, rows: int, prompt: int, completion: int, vocab: int):  # type: ignore[no-untyped-def]
    """One group of ``rows`` completions per contributor, rewards alternating 1/0."""
    from trainer.batch import build_batch
    from verify.types import AcceptedSample

    rng = np.random.default_rng(0)
    groups = []
    for c in range(contributors):
        aid, key = bytes([c]) * 16, bytes([c + 1]) * 32
        ids = rng.integers(3, vocab, prompt).astype("<u4").tobytes()
        groups.append(
            tuple(
                AcceptedSample(
                    ledger_index=0,
                    envelope_digest=bytes([c, g]) * 16,
                    contributor_key=key,
                    assignment_id=aid,
                    group_index=g,
                    group_size=rows,
                    policy_version=0,
                    task_id="t",
                    prompt_id=f"p{c}",
                    prompt_ids=ids,
                    token_ids=rng.integers(3, vocab, completion).astype("<u4").tobytes(),
                    logprobs=(-rng.exponential(1.0, completion)).astype("<f4").tobytes(),
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    reward=float(g % 2),
                    audited=False,
                )
                for g in range(rows)
            )
        )
    return build_batch(groups, 0)


MODES = ("one_pass", "one_pass_sketch", "per_contributor", "plain_mean")


def make_step(model_dir: Path, lr: float, mode: str, sketch: int = 0, keep_gib: float = 1.0):  # type: ignore[no-untyped-def]
    from bench._trust_off import Counts, PlainStep
    from trainer.loop import ensure_process_group
    from trainer.losses import get_policy_loss
    from trainer.pipeline import PipelineRunner
    from trainer.rl import RLStep
    from trainer.stages import load_stage
    from verify.aggregate import get_aggregator

    ensure_process_group()
    stage = load_stage(model_dir, 0, 1)
    kind = PlainStep if mode == "plain_mean" else RLStep
    step = kind(
        PipelineRunner(stage, 0, 1),
        torch.optim.SGD(stage.parameters(), lr=lr),
        get_policy_loss("tis"),
        get_aggregator("centered-clip"),
        grad_clip=0.0,
        gram_sketch=sketch if mode == "one_pass_sketch" else 0,
        keep_bytes=int(keep_gib * 2**30),
    )
    if step.grouped is None:
        raise SystemExit("this model's stage cannot be split per contributor; nothing to compare")
    if isinstance(step, PlainStep):
        step.counts = Counts()
    elif mode == "per_contributor":
        step.grouped = None
    return step


def update_diff(model_dir: Path, batch) -> float:  # type: ignore[no-untyped-def]
    deltas = []
    for mode in ("one_pass", "per_contributor"):
        step = make_step(model_dir, 1.0, mode)
        before = torch.cat([p.detach().flatten().clone() for p in step.params])
        step(batch)
        deltas.append(before - torch.cat([p.detach().flatten() for p in step.params]))
    return float((deltas[0] - deltas[1]).abs().max())


def time_modes(
    model_dir: Path, batch, rounds: int, sketch: int, keep_gib: float
) -> dict[str, float]:  # type: ignore[no-untyped-def]
    steps = {mode: make_step(model_dir, 0.0, mode, sketch, keep_gib) for mode in MODES}
    best = dict.fromkeys(steps, float("inf"))
    faults: dict[str, list[int]] = {name: [] for name in steps}
    for r in range(rounds + 1):
        order = list(steps) if r % 2 else list(reversed(steps))
        for name in order:  # interleaved, first and last alternating: all see the same load
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            steps[name](batch)
            if r:  # the first round is the warm-up
                best[name] = min(best[name], time.perf_counter() - start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return (
        {f"{k}_ms": round(1000 * v, 2) for k, v in best.items()}
        | {f"{k}_page_faults": int(statistics.median(v)) for k, v in faults.items()}
        | {
            "speedup": round(best["per_contributor"] / best["one_pass"], 3),
            "trainer_trust_ratio": round(best["plain_mean"] / best["one_pass"], 3),
            "sketch_trainer_trust_ratio": round(best["plain_mean"] / best["one_pass_sketch"], 3),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contributors", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8, help="completions per contributor")
    parser.add_argument("--prompt", type=int, default=12, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=8, help="completion tokens")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--sketch",
        type=int,
        default=64,
        help="width of the one_pass_sketch mode's Gram sketch (aggregator.gram_sketch)",
    )
    parser.add_argument(
        "--keep-gib",
        type=float,
        default=1.0,
        help="memory (GiB) for per-contributor gradient rows the one pass keeps between its "
        "Gram matrix and its combine (aggregator.keep_gib; default 1.0)",
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's memory thresholds at their defaults instead of keeping freed "
        "memory as the trainer loop does (trainer.allocator.retain_freed_memory)",
    )
    parser.add_argument(
        "--counts",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        help="contributor counts to time, comma-separated (default: 2, --contributors and "
        "twice it; the pass per contributor holds count x parameters float32 rows)",
    )
    parser.add_argument(
        "--model-dir", type=model_dir_arg, help="a local Hugging Face model directory"
    )
    parser.add_argument(
        "--width", type=int, help="instead: a random-init Llama of this hidden size (14M: 384)"
    )
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of --width's model")
    args = parser.parse_args()
    sizes = (args.contributors, args.rows, args.prompt, args.completion, args.rounds, args.sketch)
    if min(sizes + (args.counts or ())) < 1:
        parser.error("every count must be >= 1")
    if args.width and args.model_dir:
        parser.error("give --model-dir or --width, not both")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="contributor-grads-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    from bench.trust_overhead import build_wide_model
    from trainer.allocator import retain_freed_memory
    from trainer.base_model import ensure_base_model

    kept = False if args.default_allocator else retain_freed_memory()  # as TrainerLoop does

    if args.width:
        model_dir = build_wide_model(args.width, args.layers, tmp / "model")
        model = f"random-init Llama, hidden {args.width}, {args.layers} layers"
    elif args.model_dir:
        model_dir, model = Path(args.model_dir), str(args.model_dir)
    else:
        model_dir, model = Path(ensure_base_model("arithmetic")), "demo base model (arithmetic)"
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    counts = sorted({*(args.counts or (2, 2 * args.contributors)), args.contributors})
    by_count = {}
    for n in counts:
        say(f"{n} contributors x {args.rows} rows")
        by_count[str(n)] = time_modes(
            model_dir,
            make_batch(n, args.rows, args.prompt, args.completion, vocab),
            args.rounds,
            args.sketch,
            args.keep_gib,
        )
        say(f"{n} contributors: {json.dumps(by_count[str(n)])}")  # kept if a later count fails
    batch = make_batch(args.contributors, args.rows, args.prompt, args.completion, vocab)
    emit(
        {
            "bench": "contributor_grads",
            "model": model,
            "baselines": {
                "per_contributor": "RLStep with a forward and backward pass per contributor",
                "plain_mean": "bench._trust_off.PlainStep: one pass of the whole batch, a "
                "plain mean gradient, no aggregation (trust_overhead.py's trust-off step)",
            },
            "rows_per_contributor": args.rows,
            "tokens": args.prompt + args.completion,
            "threads": 1,
            "aggregator": "centered-clip",
            "contributors": args.contributors,
            "by_contributors": by_count,
            "speedup": by_count[str(args.contributors)]["speedup"],
            "trainer_trust_ratio": by_count[str(args.contributors)]["trainer_trust_ratio"],
            "keep_gib": args.keep_gib,
            "freed_memory_kept": kept,
            "sketch_width": args.sketch,
            "sketch_trainer_trust_ratio": by_count[str(args.contributors)][
                "sketch_trainer_trust_ratio"
            ],
            "max_update_diff": update_diff(model_dir, batch),
        }
    )


if __name__ == "__main__":
    main()
