"""Staleness benchmark: final held-out pass@1 with staleness 0, 4, 8, with and without IS.

Staleness s is emulated with every sample still verified: the in-process
network announces each new policy version to the validator s versions late
(``LocalSettings.publish_delay``), so the trainer at version v trains on
rollouts of v - s, spot-checked against v - s. "is" uses the configured loss
(tis by default) against the committed behaviour logprobs; "no_is" scores
every token as on-policy (ratio 1).

Prints progress on stderr and one JSON object on the last line of stdout:

  base                 pass@1 (greedy, held-out) of the base policy
  final                {"s0_is": ..., "s0_no_is": ..., "s4_is": ..., ...}
  improvement          final - base, same keys
  s8_is_vs_s0_is       improvement(s8_is) / improvement(s0_is)  (target >= 0.9)
  s8_no_is_vs_s0_is    improvement(s8_no_is) / improvement(s0_is)

    python bench/staleness.py [--steps 20] [--eval-problems 200] [--full] [--config FILE]

The trainer settings (learning rate, temperature, batch) come from ``--config``.

``--full`` trains 300 steps per run and evaluates on 500 problems (about
5 minutes per run on 2 CPU cores, six runs); the default is a quick
smoke-sized run whose ratios are noisy. Groups left in the buffer from an
earlier fetch are one version older, so run s trains at staleness s to s + 1
(the bound is set to s + 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._util import emit  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_one(cfg, staleness: int, correction: bool) -> tuple[float, object]:
    """Train one configuration; return (final pass@1, base eval report)."""
    from harness.local import LocalNetwork, run_local, settings_from
    from trainer.base_model import ensure_base_model

    cfg = cfg.model_copy(update={
        "max_staleness": staleness + 1,
        "loss": cfg.loss.model_copy(update={"importance_sampling": correction}),
    })
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    settings = dataclasses.replace(settings_from(cfg), publish_delay=staleness)
    net = LocalNetwork(model_dir, settings)
    try:
        history, _ = run_local(cfg, network=net, progress=False)
    finally:
        net.close()
    return history.evals[cfg.steps].metric("pass@1 (greedy)").value, history.evals[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "trainer.toml",
                        help="trainer TOML (default: configs/trainer.toml)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--full", action="store_true", help="300 steps, 500 eval problems")
    parser.add_argument("--staleness", default="0,4,8")
    args = parser.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from trainer.config import load_trainer_config

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    steps, n_eval = (300, 500) if args.full else (args.steps, args.eval_problems)
    cfg = load_trainer_config(args.config, {"steps": steps, "eval_problems": n_eval,
                                            "eval_every": steps, "checkpoint_dir": None})
    final: dict[str, float] = {}
    base = None
    for s in (int(x) for x in args.staleness.split(",")):
        for correction in (True, False):
            name = f"s{s}_{'is' if correction else 'no_is'}"
            value, base_report = run_one(cfg, s, correction)
            base = base_report.metric("pass@1 (greedy)").value
            final[name] = value
            log(f"{name}: pass@1 {base:.3f} -> {value:.3f}")
    assert base is not None
    improvement = {k: v - base for k, v in final.items()}

    def ratio(key: str) -> float | None:
        ref = improvement.get("s0_is")
        if key not in improvement or not ref:
            return None
        return round(improvement[key] / ref, 4)

    emit({
        "bench": "staleness", "steps": steps, "eval_problems": n_eval, "base": base,
        "final": final, "improvement": {k: round(v, 4) for k, v in improvement.items()},
        "s8_is_vs_s0_is": ratio("s8_is"), "s8_no_is_vs_s0_is": ratio("s8_no_is"),
    })


if __name__ == "__main__":
    main()
