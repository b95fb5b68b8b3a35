"""Run a scenario end to end: a validator, a simulated population, the trainer, an event log.

For each run (the scenario, the all-honest baseline, the no-defence ablation)
the runner builds an in-process network (``node.local``: a validator core
with its ledger, a policy-version registry) and drives it in simulated time:

* every contributor that is online and idle takes an assignment at the
  current simulated time, answers it with its strategy (honest or an
  adversary from ``harness.adversaries``) using the policy version it was
  assigned, and its group is delivered after its (measured, speed-scaled)
  compute time plus a network delay drawn from its profile; dropped messages
  are lost work (``harness.simulation``);
* the trainer (``trainer.loop.TrainerLoop``) pulls accepted samples; when the
  stream is dry it advances the simulation to the next delivery; each
  optimizer step advances simulated time by its measured duration, so slow
  contributors deliver stale samples exactly as a real network would;
* verdicts, slashes, reputation, train steps, evals and throughput go to
  ``events.jsonl`` as they happen; at the end ``audit verify`` runs on the
  run's ledger.

Real compute is done on this machine one piece at a time; only the clock is
simulated. Held-out evals are the exception: they run beside training in a
process of their own (``harness.background_evals``), are recorded in version
order as their reports come back, and take none of the simulated time.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from harness.analysis import seed_label
from harness.background_evals import BackgroundEvals, Evaluated
from harness.events import (
    EVENTS_FILE,
    Audit,
    Eval,
    EventLog,
    Start,
    Summary,
    Throughput,
    TrainStep,
)
from harness.scenario import Scenario
from harness.simulation import Simulation
from ledger.audit import verify_ledger
from node.local import LocalNetwork, LocalSettings
from rewards.tasks import generate as generate_problems
from trainer.config import AggregatorSection, LocalSection, LossSection, TrainerConfig
from trainer.evals import default_max_new_tokens
from trainer.loop import TrainerLoop, ensure_process_group
from trainer.pipeline import PipelineRunner
from trainer.stages import load_stage
from verify.errors import ConfigError, ProofTrainError


class BudgetExceeded(ProofTrainError):
    """A run reached its wall-clock cap (``trainer.budget_s``) before ``trainer.steps``.

    The run fails rather than stop early: the scenario's runs are compared step for step,
    and one cut short by a loaded machine would be read against runs that trained longer."""

    def __init__(self, run: str, step: int, steps: int, elapsed: float, budget: float) -> None:
        self.run, self.step, self.steps = run, step, steps
        self.elapsed, self.budget = elapsed, budget
        super().__init__(
            f"run {run!r} reached its wall-clock cap trainer.budget_s = {budget:g} s after "
            f"{elapsed:.0f} s at step {step} of {steps}; no run is cut short, so that the "
            "scenario's runs compare at the same step: raise trainer.budget_s in the scenario "
            "file (0: no cap) or lower trainer.steps"
        )


def _by_key(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``{fingerprint: value}`` of the metrics named ``<prefix><fingerprint>``."""
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}


def trainer_config(s: Scenario, model_dir: Path) -> TrainerConfig:
    t, v = s.trainer, s.validator
    return TrainerConfig(
        model_dir=model_dir,
        task=s.task.name,
        steps=t.steps,
        lr=t.learning_rate,
        lr_schedule=t.lr_schedule,
        warmup_steps=t.warmup_steps,
        min_lr_ratio=t.min_lr_ratio,
        loss=LossSection(name=t.loss.name, params=t.loss.params),
        aggregator=AggregatorSection(
            name=t.aggregator.name,
            params=t.aggregator.params,
            gram_sketch=t.gram_sketch,
            keep_gib=t.keep_gib,
        ),
        rules=s.rules,
        batch_groups=t.batch_groups,
        mode=t.mode,
        eval_every=t.eval_every,
        eval_problems=min(t.eval_problems, s.task.heldout),
        seed=s.seed,
        starve_timeout_s=600.0,
        skip_uniform_groups=t.skip_uniform_groups,
        local=LocalSection(
            group_size=max(2, v.group_size), max_tokens=v.max_tokens, temperature=v.temperature
        ),
    )


def run_variant(
    s: Scenario,
    work: Path,
    log: EventLog,
    *,
    progress: bool = True,
    say: Callable[[str], None] = print,
    label: str | None = None,
) -> dict:
    """One run; returns its summary figures. Its events carry ``label`` as their run
    (default ``s.run``; ``harness.analysis.seed_label`` for seeds after the first)."""
    run = label or s.run
    model_dir = s.model.ensure(s.task.name, progress=progress)
    cfg = trainer_config(s, model_dir)
    net = _local_network(s, model_dir, work)
    sim = Simulation(s, net, s.network_model(), log, run)
    log.write(
        Start(
            run=run,
            scenario=s.name,
            seed=s.seed,
            contributors={m.spec.id: m.spec.strategy for m in sim.members},
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The held-out set and its generation length, drawn once: drawing them costs about as much
    # as an eval's greedy pass on the demo model, and the scenario run evaluates every version.
    heldout = generate_problems(s.task.name, "heldout", cfg.eval_problems, s.seed)
    max_new = default_max_new_tokens(heldout, tokenizer)
    reports = _EvalRecorder(net, log, run, s.seed)
    stage = load_stage(model_dir, 0, 1)
    runner = PipelineRunner(stage, 0, 1, temperature=s.validator.temperature, seed=s.seed)
    loop = TrainerLoop(
        cfg, runner, net, publish=net.publish, weights=net.weights, wait=sim.pump, progress=False
    )
    # Evals run beside training in a process of their own (``harness.background_evals``).
    with BackgroundEvals(
        model_dir, s.task.name, heldout, max_new_tokens=max_new, seed=s.seed
    ) as evals:
        evals.submit(0, net.model(0), tag=sim.t)
        wall0 = time.monotonic()
        trained, train_s = _train(s, cfg.eval_every, loop, sim, evals, reports, wall0, progress)
        reports.record(evals.drain())
    report = verify_ledger(net.ledger.store, blobs=net.ledger.blobs)
    log.write(
        Audit(run=run, ok=report.ok, size=report.size, findings=[str(f) for f in report.findings])
    )
    first, last = reports.first, reports.last
    values = {
        "steps": loop.version,
        "samples_trained": trained,
        "sim_seconds": round(sim.t, 2),
        "train_seconds": round(train_s, 2),
        "wall_seconds": round(time.monotonic() - wall0, 2),
        "pass_at_1_first": first,
        "pass_at_1_last": last,
        "ledger": str(work / "ledger.sqlite"),
        "ledger_entries": report.size,
        "audit_ok": report.ok,
    }
    log.write(Summary(run=run, t=sim.t, values=values))
    say(
        f"{run}: pass@1 {first:.3f} -> {last:.3f} in {loop.version} steps; audit "
        f"{'ok' if report.ok else 'FAILED'}"
    )
    net.close()
    return values


def _local_network(s: Scenario, model_dir: Path, work: Path) -> LocalNetwork:
    """The run's in-process network (validator core, ledger, version registry) in ``work``,
    with no contributors of its own (the simulation brings them) and torch seeded."""
    v = s.validator
    settings = LocalSettings(
        contributors=0,
        group_size=v.group_size,
        max_tokens=v.max_tokens,
        temperature=v.temperature,
        pool=s.task.train_pool,
        task=s.task.name,
        seed=s.task.seed,
        rules=s.rules,
        groups_per_fetch=0,
        ttl_s=v.assignment_ttl_s,
    )
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # tiny models: more threads only contend on a shared machine
    torch.manual_seed(s.seed)
    ensure_process_group()
    return LocalNetwork(model_dir, settings, work_dir=work)


@dataclass
class _EvalRecorder:
    """Held-out eval reports into the ledger and the log, and the first and last pass@1."""

    net: LocalNetwork
    log: EventLog
    run: str
    seed: int
    first: float = float("nan")
    """pass@1 (greedy) of version 0."""
    last: float = float("nan")
    """pass@1 (greedy) of the latest version recorded."""

    def record(self, done: list[Evaluated]) -> None:
        """Record reports in the ledger and the log, in version order, at their step's time."""
        for e in done:
            self.net.record_eval(e.version, e.report, seed=self.seed)
            p = e.report.metric("pass@1 (greedy)")
            reward = e.report.metric("mean reward (greedy)").value
            self.log.write(
                Eval(
                    t=e.tag,
                    run=self.run,
                    step=e.version,
                    version=e.version,
                    pass_at_1=p.value,
                    ci_low=p.ci_low,
                    ci_high=p.ci_high,
                    mean_reward=reward,
                )
            )
            self.last = p.value
            if e.version == 0:
                self.first = p.value


def _train(
    s: Scenario,
    eval_every: int,
    loop: TrainerLoop,
    sim: Simulation,
    evals: BackgroundEvals,
    reports: _EvalRecorder,
    wall0: float,
    progress: bool,
) -> tuple[int, float]:
    """Train exactly ``s.trainer.steps`` steps, each advancing simulated time by its measured
    duration and logged; versions go to ``evals`` as they are due (the last one always), and
    their reports to ``reports`` as they come back. Returns the samples trained and the
    simulated seconds the optimizer steps took (their measured durations).

    Raises ``BudgetExceeded`` when the wall clock (counted from ``wall0``) passes
    ``s.trainer.budget_s`` before the last step."""
    from rollout.progress import progress as progress_bar

    run, log = sim.run, sim.log
    every_version = s.trainer.eval_every_version and s.run == "scenario"
    budget = s.trainer.budget_s or float("inf")
    steps = s.trainer.steps
    trained, evaluated, train_s = 0, 0, 0.0
    bar = progress_bar(steps, f"{run:>10}", "steps", enabled=progress)
    while loop.version < steps:
        elapsed = time.monotonic() - wall0
        if elapsed >= budget:
            bar.close()
            raise BudgetExceeded(run, loop.version, steps, elapsed, budget)
        metrics = loop.train_step()
        sim.t += metrics.get("perf/step_s", 0.0)
        train_s += metrics.get("perf/step_s", 0.0)
        trained += int(metrics.get("train/samples", 0))
        _log_step(log, run, sim.t, loop.version, metrics)
        log.write(Throughput(t=sim.t, run=run, samples_per_s=trained / max(sim.t, 1e-9)))
        bar.update(1)
        bar.set_postfix(
            reward=f"{metrics.get('train/reward', 0.0):.2f}",
            pass1="-" if math.isnan(reports.last) else f"{reports.last:.2f}",
        )
        if every_version or (eval_every and loop.version % eval_every == 0):
            evals.submit(loop.version, sim.net.model(loop.version), tag=sim.t)
            evaluated = loop.version
        reports.record(evals.ready())
    bar.close()
    if loop.version != evaluated:  # the last version is always evaluated
        evals.submit(loop.version, sim.net.model(loop.version), tag=sim.t)
    return trained, train_s


def _log_step(log: EventLog, run: str, t: float, version: int, metrics: dict[str, float]) -> None:
    """One optimizer step's ``TrainStep`` event from its metrics."""
    stale = [
        int(k.rsplit("/", 1)[1])
        for k in metrics
        if k.startswith("off_policy/staleness/")
        for _ in range(int(metrics[k]))
    ]
    log.write(
        TrainStep(
            t=t,
            run=run,
            step=version,
            version=version,
            samples=int(metrics.get("train/samples", 0)),
            staleness=stale,
            loss=metrics.get("train/loss", 0.0),
            reward_mean=metrics.get("train/reward", 0.0),
            ratio_mean=metrics.get("off_policy/ratio_mean", 1.0),
            masked_fraction=metrics.get("off_policy/masked_fraction", 0.0),
            grad_norms={
                k.rsplit("/", 1)[1]: val
                for k, val in metrics.items()
                if k.startswith("aggregate/grad_norm/")
            },
            samples_by={k: int(n) for k, n in _by_key(metrics, "damage/samples/").items()},
            weight_share=_by_key(metrics, "damage/weight/"),
            update_share=_by_key(metrics, "damage/update/"),
        )
    )


SEED_MAX = 2**63 - 1
"""The largest scenario seed (``Scenario.seed``'s bound)."""


def seeded(s: Scenario, i: int) -> Scenario:
    """Seed index ``i`` of ``s``: its root seed and its task seed both moved up by ``i``, so
    contributor keys, the network's draws, the train pool, the held-out set, torch and the
    trainer's sampling all change with it while the base policy stays the same. Seed 0 is
    ``s`` itself, so a one-seed run is the run ``s`` describes."""
    if i == 0:
        return s
    if s.seed + i > SEED_MAX:
        raise ConfigError(f"seed {s.seed} + {i} exceeds the largest scenario seed {SEED_MAX}")
    task = s.task.model_copy(update={"seed": s.task.seed + i})
    return s.model_copy(update={"seed": s.seed + i, "task": task})


def run_scenario(
    scenario: Scenario, out_dir: str | Path, progress: bool = True, seeds: int = 1
) -> Path:
    """Run the scenario and its enabled baselines into ``out_dir``, each at ``seeds`` seeds
    (``seeded``); returns ``out_dir``.

    Seeds run one after another, each with all its runs, so an interrupted run directory
    holds whole seeds plus at most one partial one. Seed ``i``'s run ``r`` is labelled
    ``harness.analysis.seed_label(r, i)`` in the log and works in ``out_dir/runs/<label>``:
    seed 0 is ``scenario``, ``honest`` and ``no-defence`` in ``runs/<run>`` as a one-seed
    run has always been; later seeds are ``<run>@s<i>``.
    """
    if seeds < 1:
        raise ConfigError(f"seeds must be at least 1, got {seeds}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = out / EVENTS_FILE
    if events.exists():
        events.unlink()  # a rerun replaces the previous log, never mixes with it
    # ... and the previous runs' ledgers: a simulation starts from the base policy, so it
    # cannot continue a ledger that has published versions already.
    shutil.rmtree(out / "runs", ignore_errors=True)
    with EventLog(events) as log:
        for i in range(seeds):
            s = seeded(scenario, i)
            for run in s.runs():
                label = seed_label(run, i)
                run_variant(
                    s.variant(run), out / "runs" / label, log, progress=progress, label=label
                )
    return out
