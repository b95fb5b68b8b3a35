"""Asynchronous against synchronous training under the same simulated latency, over seeds.

Both runs use the same honest population (sixteen consumer machines that
generate 20x slower than this one, over heavy-tailed lognormal wide-area
links, median ``--latency-ms``, default 0.8 s, each uploading one group while
it generates the next:
``uploads = 2``, ``prooftrain contributor --uploads 2``), the same seeds and
the same number of optimizer steps and the demo's learning recipe (rollouts at
temperature 0.5, truncated IS capped at 2, a cosine schedule); only
``trainer.mode`` differs. A step takes eight groups, half the demo's sixteen, so
the peak learning rate is the demo's 1.2e-4 scaled by the square root of the
batch, 8.5e-5 (at 1.2e-4 with eight groups pass@1 first falls from 0.25 to
0.16-0.20 for tens of steps, in both modes, and where it recovers decides the
time to target more than the mode does). Sync trains only on
rollouts of the current version, so after each publication it waits for fresh
generations and the trainer idles; async trains on whatever arrived within the
staleness bound while the next rollouts are in flight. By default sync
wastes no work: it hands out no more groups of a version than a
step takes (``harness.simulation.SyncDemand``), so no work goes stale.
``--sync-overassign`` compares with the other sync design instead: every
contributor keeps generating and a step takes the first groups to arrive,
which wastes the rest but shortens the wait for the slowest of a step's groups.
Both modes pay every assignment's request and answer and every new version's
weight download on the contributor's link (``network.setup_latency``).

The ratio is a property of the simulated network as much as of the trainer:
``--sweep`` runs the comparison at latency medians of 0.1, 0.8 and 3 s and
reports each setting's figures with ``latency_over_step`` (the median latency
over the mean optimizer step) and each mode's ``compute_share``, the share of
simulated time that is measured compute (optimizer steps; the rest is waiting
for the simulated network and the contributors' scaled generation).

Each of ``--seeds`` seeds runs both modes, paired: seed i moves the scenario's
root and task seeds by i (``harness.run.seeded``: keys, network draws, train
pool, held-out set, sampling). Time to target is the simulated time of the first
held-out eval at which the mean pass@1 of the last ``--window`` evals (that one
and those before it) reaches ``--target``: a sustained crossing, so one lucky
eval does not count. Each run evaluates ``--evals`` times on ``--eval-problems``
held-out problems (defaults 24 and 1000: an eval's pass@1 is within about
+-0.03 of the policy's, and the crossing is placed to within 5 of 120 steps).
A run that never reaches it is censored at its run length: its time counts as
the whole run, which understates it. Sync censored only makes the sync/async
ratio a lower bound; async censored makes the ratio overstate async's
advantage, and ``censoring`` says which happened. Intervals are 95%: Student t
over seeds for each mode's mean, paired bootstrap over seeds (expanded
percentile, ``harness.stats``) for the ratios.

Prints progress on stderr and one JSON object on the last line of stdout, naming its
``baseline``; with ``--sweep`` the figures below are per setting, under ``sweep``:

  async_samples_per_s / sync_samples_per_s   mean samples trained per simulated second
  throughput_ratio, throughput_ratio_ci      async / sync (ratio of means), target >= 2
  async_time_to_target_s / sync_...          mean simulated seconds to ``target``, censored
                                             runs at their run length; ``..._ci``: t interval
  async_reached / sync_reached               seeds whose run reached the target
  time_ratio, time_ratio_ci                  sync / async mean time to target, target >= 2
  time_ratio_call                            yes / no / inconclusive: time_ratio >= 2 at 95%
  censoring                                  none, sync-only (a lower bound) or async (overstated)
  async_compute_share / sync_compute_share   share of simulated time spent in optimizer steps
  latency_median_s, latency_over_step, step_s
                                             the setting, over the mean measured step time
  per_seed                                   each seed's figures, the first single eval at
                                             the target (``first_crossing_s``) and every
                                             eval [sim s, pass@1]

    python bench/async.py [--steps 120] [--target 0.30] [--window 3] [--evals 24]
                          [--eval-problems 1000] [--max-staleness 4] [--uploads 2] [--seeds 3]
                          [--latency-ms 800] [--sweep] [--sync-overassign]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._util import emit  # noqa: E402

SWEEP_MS = (100.0, 800.0, 3000.0)
"""Latency medians ``--sweep`` runs at, in ms."""
BASELINE = (
    "sync: the same population, seeds, steps and recipe with trainer.mode = sync, {design}; "
    "both modes pay each assignment's request and answer and each new version's weight "
    "download on the contributor's link (network.setup_latency)"
)
DESIGNS = {
    False: "handing out no more groups of a version than a step takes "
    "(harness.simulation.SyncDemand: no work goes stale)",
    True: "every contributor kept generating and each step taking the first groups of its "
    "version to arrive (--sync-overassign: the rest go stale)",
}

SCENARIO = """
name = "async-bench"
seed = 3
[task]
train_pool = 2048
heldout = {eval_problems}
[[population.groups]]
strategy = "honest"
count = 16
network = "consumer"
uploads = {uploads}
[network]
setup_latency = true
[network.profiles.consumer]
latency = {{ model = "lognormal", params = {{ median_ms = {latency_ms}, sigma = 1.0 }} }}
jitter_ms = 100
compute_speed = 0.05
[rules]
max_staleness = {max_staleness}
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
eval_problems = {eval_problems}
mode = "{mode}"
sync_demand = {sync_demand}
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def scenario_text(mode: str, args: argparse.Namespace) -> str:
    """The scenario TOML of one ``mode`` run under the command line's ``args``."""
    return SCENARIO.format(
        steps=args.steps,
        mode=mode,
        lr=args.lr,
        uploads=args.uploads,
        eval_every=max(1, args.steps // args.evals),
        eval_problems=args.eval_problems,
        max_staleness=args.max_staleness,
        latency_ms=args.latency_ms,
        sync_demand="false" if args.sync_overassign else "true",
    )


def run(mode: str, seed: int, args: argparse.Namespace, work: Path) -> dict:
    """One ``mode`` run at seed index ``seed``; its throughput, time to target and evals."""
    from harness.events import EVENTS_FILE, Eval, EventLog, read_events
    from harness.run import run_variant, seeded
    from harness.scenario import load_scenario

    path = work / f"{mode}.toml"
    path.write_text(scenario_text(mode, args))
    scenario = seeded(load_scenario(path), seed)
    log_path = work / f"{mode}-s{seed}" / EVENTS_FILE
    log_path.parent.mkdir(parents=True)
    with EventLog(log_path) as log:
        values = run_variant(
            scenario,
            work / f"{mode}-s{seed}" / "run",
            log,
            progress=True,
            say=lambda m: print(f"seed {seed}: {m}", file=sys.stderr),
        )
    evals = [e for e in read_events(log_path) if isinstance(e, Eval)]
    curve = [(e.t, e.pass_at_1) for e in evals]
    return {
        "samples_per_s": values["samples_trained"] / max(values["sim_seconds"], 1e-9),
        "compute_share": values["train_seconds"] / max(values["sim_seconds"], 1e-9),
        "step_s": values["train_seconds"] / max(values["steps"], 1),
        "sim_seconds": values["sim_seconds"],
        "time_to_target_s": sustained_crossing(curve, args.target, args.window),
        "first_crossing_s": sustained_crossing(curve, args.target, 1),
        "final_pass_at_1": values["pass_at_1_last"],
        "first_pass_at_1": values["pass_at_1_first"],
        "evals": [[round(e.t, 1), e.pass_at_1] for e in evals],
    }


def sustained_crossing(
    curve: list[tuple[float, float]], target: float, window: int
) -> float | None:
    """Time of the first eval of ``curve`` ((time, pass@1) in order) at which the mean of the
    last ``window`` evals, it included, is at least ``target``; None if there is none. The
    first ``window - 1`` evals cannot count: their window is not full."""
    for i in range(window - 1, len(curve)):
        last = [p for _, p in curve[i - window + 1 : i + 1]]
        if sum(last) / window >= target:
            return curve[i][0]
    return None


def _censored_time(r: dict) -> float:
    """Time to target, or the run's whole length when it never got there (a lower bound)."""
    t = r["time_to_target_s"]
    return float(r["sim_seconds"] if t is None else t)


def _ci(iv) -> list[float] | None:  # noqa: ANN001
    return None if iv is None else [round(iv.low, 3), round(iv.high, 3)]


def _time_call(call: str, async_censored: bool, sync_censored: bool) -> str:
    """The call on time_ratio >= 2, kept only where censoring cannot have made it: a censored
    async run shortens async's time (a ``yes`` may be wrong), a censored sync run shortens
    sync's (a ``no`` may be wrong)."""
    if (call == "yes" and async_censored) or (call == "no" and sync_censored):
        return "inconclusive"
    return call


def summarize(a: list[dict], s: list[dict], target: float) -> dict:
    """The bench's figures from paired per-seed results ``a`` (async) and ``s`` (sync)."""
    from harness.stats import decide, paired_bootstrap, ratio_of_means, t_interval

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 3)

    thr_a, thr_s = [r["samples_per_s"] for r in a], [r["samples_per_s"] for r in s]
    tta_a, tta_s = [_censored_time(r) for r in a], [_censored_time(r) for r in s]
    reached_a = sum(r["time_to_target_s"] is not None for r in a)
    reached_s = sum(r["time_to_target_s"] is not None for r in s)
    time_ci = paired_bootstrap(tta_s, tta_a, ratio_of_means)
    thr_ci = paired_bootstrap(thr_a, thr_s, ratio_of_means)
    if reached_a < len(a):
        censoring = (
            f"async: {len(a) - reached_a} async and {len(s) - reached_s} sync runs never "
            "reached the target; time_ratio overstates async's advantage"
        )
    elif reached_s < len(s):
        censoring = (
            f"sync only: {len(s) - reached_s} sync runs never reached the target; "
            "time_ratio is a lower bound"
        )
    else:
        censoring = "none"
    return {
        "async_samples_per_s": mean(thr_a),
        "sync_samples_per_s": mean(thr_s),
        "throughput_ratio": round(float(ratio_of_means(thr_a, thr_s)), 3),
        "throughput_ratio_ci": _ci(thr_ci),
        "throughput_ratio_target": 2.0,
        "async_sim_seconds": mean([r["sim_seconds"] for r in a]),
        "sync_sim_seconds": mean([r["sim_seconds"] for r in s]),
        "async_time_to_target_s": mean(tta_a),
        "async_time_to_target_ci": _ci(t_interval(tta_a)),
        "sync_time_to_target_s": mean(tta_s),
        "sync_time_to_target_ci": _ci(t_interval(tta_s)),
        "async_reached": f"{reached_a}/{len(a)}",
        "sync_reached": f"{reached_s}/{len(s)}",
        "time_ratio": round(float(ratio_of_means(tta_s, tta_a)), 3),
        "time_ratio_ci": _ci(time_ci),
        "time_ratio_target": 2.0,
        "time_ratio_call": _time_call(decide(time_ci, 2.0), reached_a < len(a), reached_s < len(s)),
        "censoring": censoring,
        "target_pass_at_1": target,
        "async_compute_share": mean([r.get("compute_share", 0.0) for r in a]),
        "sync_compute_share": mean([r.get("compute_share", 0.0) for r in s]),
        "step_s": mean([r.get("step_s", 0.0) for r in [*a, *s]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps of every run")
    parser.add_argument(
        "--target", type=float, default=0.30, help="held-out pass@1 to reach (default 0.30)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=3,
        help="evals averaged for the sustained crossing (1: the first single eval; default 3)",
    )
    parser.add_argument(
        "--evals", type=int, default=24, help="held-out evals per run, evenly spaced (default 24)"
    )
    parser.add_argument(
        "--eval-problems",
        type=int,
        default=1000,
        help="held-out problems per eval (default 1000: pass@1 within about +-0.03)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=8.5e-5,
        help="peak learning rate (cosine schedule; default 8.5e-5, see above)",
    )
    parser.add_argument(
        "--uploads",
        type=int,
        default=2,
        help="groups each contributor may have uploading while it generates the next "
        "(1: it waits for each verdict)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="versions an async step may train behind (the network rule; default 4)",
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds, each running both modes (default 3)"
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=800.0,
        help="median one-way latency of the contributors' links (default 800)",
    )
    parser.add_argument(
        "--sync-overassign",
        action="store_true",
        help="sync keeps every contributor generating (trainer.sync_demand = false) instead "
        "of handing out only what a step takes",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="run at each latency median of SWEEP_MS (0.1, 0.8 and 3 s) and report each",
    )
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.window < 1:
        parser.error("--window must be at least 1")
    if args.evals < 1 or args.eval_problems < 1:
        parser.error("--evals and --eval-problems must be at least 1")
    if args.max_staleness < 0:
        parser.error("--max-staleness must be at least 0")
    settings = SWEEP_MS if args.sweep else (args.latency_ms,)
    results = []
    for latency_ms in settings:
        args.latency_ms = latency_ms
        results.append(compare(args))
    common = {
        "bench": "async",
        "baseline": BASELINE.format(design=DESIGNS[args.sync_overassign]),
        "sync_overassign": args.sync_overassign,
        "steps": args.steps,
        "seeds": args.seeds,
        "uploads": args.uploads,
        "compute_speed": 0.05,
        "window": args.window,
        "evals": args.evals,
        "max_staleness": args.max_staleness,
        "eval_problems": args.eval_problems,
    }
    if args.sweep:
        emit({**common, "sweep": results})
    else:
        emit({**common, **results[0]})


def compare(args: argparse.Namespace) -> dict:
    """Both modes at every seed under ``args``' latency: the figures and each seed's runs."""
    a, s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for seed in range(args.seeds):
            a.append(run("async", seed, args, work))
            s.append(run("sync", seed, args, work))
    summary = summarize(a, s, args.target)
    return {
        "latency_median_s": args.latency_ms / 1e3,
        "latency_over_step": round(args.latency_ms / 1e3 / max(summary["step_s"], 1e-9), 2),
        **summary,
        "per_seed": [
            {
                "seed": i,
                **{
                    f"{mode}_{k}": r[k]
                    for mode, r in (("async", ra), ("sync", rs))
                    for k in (
                        "samples_per_s",
                        "sim_seconds",
                        "compute_share",
                        "time_to_target_s",
                        "first_crossing_s",
                        "first_pass_at_1",
                        "final_pass_at_1",
                        "evals",
                    )
                },
            }
            for i, (ra, rs) in enumerate(zip(a, s, strict=True))
        ],
    }


if __name__ == "__main__":
    main()
