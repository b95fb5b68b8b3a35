"""Asynchronous against synchronous training under the same simulated latency.

Both runs use the same honest population (sixteen consumer machines that
generate 20x slower than this one, over heavy-tailed lognormal wide-area
links, median 0.8 s, each uploading one group while it generates the next:
``uploads = 2``, ``prooftrain contributor --uploads 2``), the same seeds and
the same number of optimizer steps and the demo's learning recipe (rollouts at
temperature 0.5, truncated IS capped at 2, a cosine schedule from 1.2e-4); only
``trainer.mode`` differs. A step takes eight groups: sync trains only on
rollouts of the current version, so after each publication it waits for fresh
generations while work started under the older version is wasted and the
trainer idles; async trains on whatever arrived within the staleness bound
while the next rollouts are in flight. Prints progress on stderr and one JSON object on
the last line of stdout:

  async_samples_per_s / sync_samples_per_s   samples trained per simulated second
  throughput_ratio                           async / sync (target >= 2)
  async_time_to_target_s / sync_...          simulated seconds until held-out pass@1
                                             first reaches ``target`` (null if never)
  time_ratio                                 sync / async time to target
  time_ratio_at_least                        when only async reached the target: sync's
                                             whole run / async's time to target
  async_evals / sync_evals                   every held-out eval as [simulated s, pass@1]

    python bench/async.py [--steps 80] [--target 0.30] [--uploads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._util import emit  # noqa: E402

SCENARIO = """
name = "async-bench"
seed = 3
[task]
train_pool = 2048
heldout = 500
[[population.groups]]
strategy = "honest"
count = 16
network = "consumer"
uploads = {uploads}
[network.profiles.consumer]
latency = {{ model = "lognormal", params = {{ median_ms = 800, sigma = 1.0 }} }}
jitter_ms = 100
compute_speed = 0.05
[rules]
max_staleness = 4
[validator]
group_size = 8
max_tokens = 8
temperature = 0.5
[trainer]
steps = {steps}
batch_groups = 8
learning_rate = {lr}
lr_schedule = "cosine"
warmup_steps = 10
min_lr_ratio = 0.1
loss = {{ name = "tis", params = {{ cap = 2.0 }} }}
eval_every = {eval_every}
eval_problems = 500
mode = "{mode}"
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def run(mode: str, args: argparse.Namespace, work: Path) -> dict:
    from harness.events import EVENTS_FILE, Eval, EventLog, read_events
    from harness.run import run_variant
    from harness.scenario import load_scenario

    path = work / f"{mode}.toml"
    path.write_text(
        SCENARIO.format(
            steps=args.steps,
            mode=mode,
            lr=args.lr,
            uploads=args.uploads,
            eval_every=max(1, args.steps // 8),
        )
    )
    scenario = load_scenario(path)
    log_path = work / mode / EVENTS_FILE
    log_path.parent.mkdir(parents=True)
    with EventLog(log_path) as log:
        values = run_variant(
            scenario,
            work / mode / "run",
            log,
            progress=True,
            say=lambda m: print(m, file=sys.stderr),
        )
    evals = [e for e in read_events(log_path) if isinstance(e, Eval)]
    hit = next((e.t for e in evals if e.pass_at_1 >= args.target), None)
    return {
        "samples_per_s": values["samples_trained"] / max(values["sim_seconds"], 1e-9),
        "sim_seconds": values["sim_seconds"],
        "time_to_target_s": hit,
        "final_pass_at_1": values["pass_at_1_last"],
        "first_pass_at_1": values["pass_at_1_first"],
        "evals": [[round(e.t, 1), e.pass_at_1] for e in evals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--target", type=float, default=0.30)
    parser.add_argument(
        "--lr", type=float, default=1.2e-4, help="peak learning rate (cosine schedule)"
    )
    parser.add_argument(
        "--uploads",
        type=int,
        default=2,
        help="groups each contributor may have uploading while it generates the next "
        "(1: it waits for each verdict)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        a = run("async", args, work)
        s = run("sync", args, work)
    ta, ts = a["time_to_target_s"], s["time_to_target_s"]
    emit(
        {
            "bench": "async",
            "steps": args.steps,
            "target_pass_at_1": args.target,
            "async_samples_per_s": round(a["samples_per_s"], 3),
            "sync_samples_per_s": round(s["samples_per_s"], 3),
            "throughput_ratio": round(a["samples_per_s"] / max(s["samples_per_s"], 1e-9), 3),
            "throughput_ratio_target": 2.0,
            "async_sim_seconds": a["sim_seconds"],
            "sync_sim_seconds": s["sim_seconds"],
            "async_time_to_target_s": ta,
            "sync_time_to_target_s": ts,
            "time_ratio": round(ts / ta, 3) if ta and ts else None,
            # sync never reached the target: it would have taken longer than its whole run
            "time_ratio_at_least": (round(s["sim_seconds"] / ta, 3) if ta and not ts else None),
            "async_pass_at_1": [a["first_pass_at_1"], a["final_pass_at_1"]],
            "sync_pass_at_1": [s["first_pass_at_1"], s["final_pass_at_1"]],
            "async_evals": a["evals"],
            "sync_evals": s["evals"],
            "uploads": args.uploads,
        }
    )


if __name__ == "__main__":
    main()
