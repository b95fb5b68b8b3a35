"""Staleness benchmark: final held-out pass@1 with staleness 0, 4, 8, with and without IS.

Staleness s is emulated with every sample still verified: the in-process
network announces each new policy version to the validator s versions late
(``LocalSettings.publish_delay``), so the trainer at version v trains on
rollouts of v - s, spot-checked against v - s. "is" uses the configured loss
(tis by default) against the committed behaviour logprobs; "no_is" scores
every token as on-policy (ratio 1). Groups left in the buffer from an earlier
fetch are one version older, so run s trains at staleness s to s + 1 (the
bound is set to s + 1).

Every run uses the trainer settings of ``--config`` (learning-rate schedule,
temperature, batch) with ``steps`` and the peak learning rate (``--lr``)
replaced. The default ``--lr 7e-5`` is the staleness-tolerant setting: the
trainer's own 1.5e-4 is tuned for the fastest on-policy learning, and a policy
that moves that fast leaves 8-version-old rollouts far behind (behaviour KL
about 0.22 nats per token; s8 reached 0.82 of s0's improvement over three
seeds), while at 7e-5 s0 gives up about 8% of its improvement and s8 keeps
nearly all of it. ``--lr 0`` keeps the config's rate. The schedule decays over
the run, so the final policy is a settled one rather than one sample of a
noisy trajectory, and the final eval uses more problems than the training
run's. Both matter: a greedy pass@1 on 300 problems moves by about +-0.05
between neighbouring versions at a constant learning rate, which is the size
of the effect being measured.

Prints progress on stderr and one JSON object on the last line of stdout:

  base                 per seed: pass@1 (greedy, held-out) of the base policy
  final                {"s0_is": [per seed], "s0_no_is": [...], "s4_is": [...], ...}
  final_ci             95% Wilson interval of each final figure
  improvement          final - base, averaged over seeds, same keys
  improvement_per_seed the same, per seed
  s8_is_vs_s0_is       improvement(s8_is) / improvement(s0_is)  (target >= 0.9)
  s8_is_vs_s0_is_per_seed
  s8_no_is_vs_s0_is    improvement(s8_no_is) / improvement(s0_is)
  off_policy           per run: mean staleness, IS ratio range and clipped share
  seconds              per run wall time

    python bench/staleness.py [--steps 20] [--eval-problems 200] [--full] [--config FILE]
                              [--staleness 0,4,8] [--corrections is,no_is] [--seeds 0,1,2]
                              [--lr 7e-5]

One seed's ratio is noisy: a 1000-problem eval has a 95% interval of about
+-0.03 on each final figure, which moves a ratio of two ~0.27 improvements by
about +-0.15; several seeds average that down.

``--full`` trains 300 steps per run and evaluates on 1000 problems (six runs;
about 6 minutes per run with configs/trainer.toml on a lightly loaded 2-core
machine, up to 15 for s8 without correction, whose stalled policy makes most
groups uniform); the default is a quick smoke-sized run whose ratios are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._util import emit  # noqa: E402

OFF_POLICY_KEYS = (
    "off_policy/staleness_mean",
    "off_policy/ratio_min",
    "off_policy/ratio_max",
    "off_policy/clipped_fraction",
    "off_policy/masked_fraction",
    "off_policy/kl_behaviour",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class RunResult:
    final: float
    final_ci: tuple[float, float]
    base: float
    off_policy: dict[str, float]
    seconds: float


def run_one(cfg, staleness: int, correction: bool, final_problems: int, seed: int) -> RunResult:
    """Train one configuration; evaluate the base and the final policy on ``final_problems``."""
    from transformers import AutoTokenizer

    from node.local import LocalNetwork, run_local, settings_from
    from trainer.base_model import ensure_base_model
    from trainer.evals import evaluate

    cfg = cfg.model_copy(
        update={
            "rules": cfg.rules.model_copy(update={"max_staleness": staleness + 1}),
            "seed": seed,
            "loss": cfg.loss.model_copy(update={"importance_sampling": correction}),
        }
    )
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    settings = dataclasses.replace(settings_from(cfg), publish_delay=staleness)
    sums: dict[str, float] = {}
    count = 0

    def on_metrics(version: int, metrics: dict[str, float]) -> None:
        nonlocal count
        if "train/loss" not in metrics:
            return
        count += 1
        for key in OFF_POLICY_KEYS:
            if key in metrics:
                sums[key] = sums.get(key, 0.0) + metrics[key]

    start = time.monotonic()
    net = LocalNetwork(model_dir, settings)
    try:
        run_local(cfg, network=net, progress=False, on_metrics=on_metrics)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        reports = [
            evaluate(
                (net.model(v), tokenizer),
                cfg.task,
                "heldout",
                n=final_problems,
                k=1,
                samples=1,
                seed=cfg.seed,
            ).metric("pass@1 (greedy)")
            for v in (0, cfg.steps)
        ]
    finally:
        net.close()
    base, final = reports
    return RunResult(
        final=final.value,
        final_ci=(final.ci_low, final.ci_high),
        base=base.value,
        off_policy={k.split("/", 1)[1]: round(v / max(count, 1), 4) for k, v in sums.items()},
        seconds=time.monotonic() - start,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        type=Path,
        default=REPO / "configs" / "trainer.toml",
        help="trainer TOML (default: configs/trainer.toml)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--eval-problems",
        type=int,
        default=200,
        help="held-out problems of the base and final evals",
    )
    parser.add_argument("--full", action="store_true", help="300 steps, 1000 eval problems")
    parser.add_argument("--staleness", default="0,4,8")
    parser.add_argument(
        "--corrections",
        default="is,no_is",
        help="which of is (configured loss) and no_is (ratio 1) to run",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=7e-5,
        help="peak learning rate of every run (default 7e-5; 0 keeps --config's)",
    )
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds (problem pool, contributors, trainer, eval set); "
        "every configuration runs once per seed and the ratios use the "
        "mean improvement over seeds",
    )
    args = parser.parse_args()
    corrections = args.corrections.split(",")
    if not corrections or set(corrections) - {"is", "no_is"}:
        parser.error("--corrections takes a comma-separated subset of is,no_is")

    import torch
    from transformers.utils import logging as hf_logging

    from trainer.config import load_trainer_config

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    steps, n_eval = (300, 1000) if args.full else (args.steps, args.eval_problems)
    # The loop's own evals are off: the base and final policies are evaluated once each,
    # on n_eval problems, after the run.
    overrides: dict[str, object] = {"steps": steps, "eval_every": 0, "checkpoint_dir": None}
    if args.lr > 0:
        overrides["lr"] = args.lr
    cfg = load_trainer_config(args.config, overrides)
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[str, list[RunResult]] = {}
    for seed in seeds:
        for s in (int(x) for x in args.staleness.split(",")):
            for correction in (c == "is" for c in corrections):
                name = f"s{s}_{'is' if correction else 'no_is'}"
                r = run_one(cfg, s, correction, n_eval, seed)
                results.setdefault(name, []).append(r)
                log(
                    f"seed {seed} {name}: pass@1 {r.base:.3f} -> {r.final:.3f} "
                    f"[{r.final_ci[0]:.3f}, {r.final_ci[1]:.3f}] in {r.seconds:.0f}s {r.off_policy}"
                )
    # Each seed has its own eval set and base figure: improvements are per seed, then averaged.
    per_seed = {k: [r.final - r.base for r in rs] for k, rs in results.items()}
    improvement = {k: sum(v) / len(v) for k, v in per_seed.items()}

    def ratio(key: str) -> float | None:
        ref = improvement.get("s0_is")
        if key not in improvement or not ref:
            return None
        return round(improvement[key] / ref, 4)

    def seed_ratios(key: str) -> list[float | None] | None:
        if key not in per_seed or "s0_is" not in per_seed:
            return None
        return [
            round(a / b, 4) if b else None
            for a, b in zip(per_seed[key], per_seed["s0_is"], strict=True)
        ]

    emit(
        {
            "bench": "staleness",
            "steps": steps,
            "eval_problems": n_eval,
            "seeds": seeds,
            "lr": cfg.lr,
            "base": [r.base for r in next(iter(results.values()))],
            "final": {k: [r.final for r in rs] for k, rs in results.items()},
            "final_ci": {
                k: [[round(x, 4) for x in r.final_ci] for r in rs] for k, rs in results.items()
            },
            "improvement": {k: round(v, 4) for k, v in improvement.items()},
            "improvement_per_seed": {k: [round(x, 4) for x in v] for k, v in per_seed.items()},
            "s8_is_vs_s0_is": ratio("s8_is"),
            "s8_no_is_vs_s0_is": ratio("s8_no_is"),
            "s8_is_vs_s0_is_per_seed": seed_ratios("s8_is"),
            "off_policy": {k: [r.off_policy for r in rs] for k, rs in results.items()},
            "seconds": {k: [round(r.seconds, 1) for r in rs] for k, rs in results.items()},
        }
    )


if __name__ == "__main__":
    main()
