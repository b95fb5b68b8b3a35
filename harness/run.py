"""Run a scenario end to end: a validator, a simulated population, the trainer, an event log.

For each run (the scenario, the all-honest baseline, the no-defence ablation)
the runner builds an in-process network (``node.local``: a validator core
with its ledger, a policy-version registry) and drives it in simulated time:

* every contributor that is online and idle takes an assignment at the
  current simulated time, answers it with its strategy (honest or an
  adversary from ``harness.adversaries``) using the policy version it was
  assigned, and its group is delivered after its (measured, speed-scaled)
  compute time plus a network delay drawn from its profile; dropped messages
  are lost work;
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

import hashlib
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import torch
from transformers import AutoTokenizer

from harness.adversaries.base import (
    Context,
    Feedback,
    Strategy,
    make_strategy,
    observe,
    plain_generation,
    rejoins,
)
from harness.analysis import seed_label
from harness.background_evals import BackgroundEvals, Evaluated
from harness.events import (
    EVENTS_FILE,
    Audit,
    Eval,
    EventLog,
    Reputation,
    Slash,
    Start,
    Summary,
    Throughput,
    TrainStep,
)
from harness.events import Verdict as VerdictEvent
from harness.network import DeliveryQueue, SimulatedNetwork
from harness.scenario import ContributorSpec, Scenario
from ledger.audit import verify_ledger
from node.local import LocalNetwork, LocalSettings, RegistryOracle
from node.validator.core import SLASHED, SubmitResult
from rewards.tasks import generate as generate_problems
from rollout.backends import TransformersBackend, generate_grouped
from rollout.worker import open_assignment
from trainer.config import AggregatorSection, LocalSection, LossSection, TrainerConfig
from trainer.evals import default_max_new_tokens
from trainer.loop import TrainerLoop, ensure_process_group
from trainer.pipeline import PipelineRunner
from trainer.stages import load_stage
from verify.errors import AdmissionError, ConfigError, Reason, VerificationError
from verify.keys import SigningKey
from verify.types import SignedAssignment

IDLE_RETRY_S = 5.0
"""Simulated seconds a contributor waits after a refused or lost request."""


@dataclass
class Member:
    spec: ContributorSpec
    key: SigningKey
    strategy: Strategy
    ctx: Context
    free_at: float = 0.0
    retired: bool = False
    uploading: list[float] = field(default_factory=list)
    """When each of its groups still on the wire arrives (or is given up as lost)."""
    comebacks: int = 0
    """Fresh keys it has registered after a ban (whitewashing)."""


def fingerprint(key: bytes) -> str:
    """A contributor key's label in events: its first 8 hex digits, as the trainer's metrics
    (``aggregate/grad_norm/``, ``damage/…``) name it."""
    return key.hex()[:8]


def free_after(uploading: list[float], ready: float, uploads: int) -> tuple[list[float], float]:
    """When a contributor that finished generating at ``ready`` may start its next group.

    ``uploading`` holds the finish times of its groups on the wire, including
    the one just generated. With ``uploads`` = 1 it waits for that group to
    arrive; with more it keeps generating until ``uploads`` groups are on the
    wire at once, then waits for the earliest to finish. Returns the groups
    still on the wire at ``ready`` and the time it is free.
    """
    pending = sorted(t for t in uploading if t > ready)
    excess = len(pending) - uploads
    return pending, (pending[excess] if excess >= 0 else ready)


class Simulation:
    """The simulated population around one validator (see the module docstring)."""

    def __init__(
        self, scenario: Scenario, net: LocalNetwork, sim: SimulatedNetwork, log: EventLog, run: str
    ) -> None:
        self.net, self.sim, self.log, self.run = net, sim, log, run
        self.t = 0.0
        self._pumped_at = 0.0
        self.queue = DeliveryQueue()
        self._backends: dict[int, TransformersBackend] = {}
        shared: dict = {}  # colluding identities share what they generated
        problems = {p.id: p for p in net.validator.problems}  # the public train pool
        self.members: list[Member] = []
        for spec in scenario.contributors():
            key = SigningKey.from_seed(spec.seed.to_bytes(32, "little"))
            net.validator.register(key.public.raw, spec.id)
            ctx = Context(
                key,
                self._backend(0),
                net.codec,
                net.validator.key.public,
                oracle=RegistryOracle(net.registry),
                shared=shared,
                problems=problems,
                clock=self._now_ms,
            )
            ctx.rng = np.random.default_rng(spec.seed)
            self.members.append(Member(spec, key, make_strategy(spec.strategy, **spec.params), ctx))
        self.accepted_samples = 0
        for m in self.members:  # each key's first event: its registration
            self._registered(m, 0.0)

    def _now_ms(self) -> int:
        """Simulated time in ms: what a contributor's headers say (a run repeats with its seed)."""
        return int(self.t * 1000)

    def _backend(self, version: int) -> TransformersBackend:
        if version not in self._backends:
            self._backends = {v: b for v, b in self._backends.items() if v >= version - 8}
            self._backends[version] = TransformersBackend(self.net.registry[version])
        return self._backends[version]

    # -- the trainer's wait hook
    def pump(self) -> None:
        """Start work for idle contributors, then advance to the next delivery and make it.

        A contributor that fell idle while the trainer was busy (between two
        pumps) starts its next job when it fell idle, not when the trainer next
        waits: contributors work while the trainer trains. It starts at most
        ``uploads`` groups per pump: their compute runs on this machine, so
        generation follows the trainer's demand instead of racing ahead of it.
        Jobs start in rounds (every idle contributor's first, then second...),
        and each round's plain generations run as one batch (:meth:`_prefetch`).
        """
        for r in range(max((m.spec.uploads for m in self.members), default=0)):
            due = [
                (m, max(m.free_at, self._pumped_at))
                for m in self.members
                if r < m.spec.uploads and self._idle(m)
            ]
            if not due:
                break
            jobs = self._assign_all(due)
            self._prefetch(jobs)
            for job in jobs:
                self._answer(*job)
        nxt = self.queue.next_ready_at()
        if nxt is None:
            waiting = [m.free_at for m in self.members if not m.retired]
            self.t = max(self.t, min(waiting, default=self.t)) + 1e-3
        else:
            self.t = max(self.t, nxt)
            self._deliver_all(self.queue.pop_ready(self.t))
        self._pumped_at = self.t

    def _idle(self, m: Member) -> bool:
        return not m.retired and m.free_at <= self.t and self.sim.is_online(m.spec.id, self.t)

    def _assign_all(
        self, due: list[tuple[Member, float]]
    ) -> list[tuple[Member, SignedAssignment, float]]:
        """Ask the validator for work for each ``(member, at)``; a refusal idles the
        contributor; a banned one retires, or comes back under a fresh key if its strategy
        rejoins (:meth:`_rejoin`)."""
        jobs = []
        answers = self.net.validator.assign_many([m.key.public.raw for m, _ in due])
        for (m, at), sealed in zip(due, answers, strict=True):
            if isinstance(sealed, AdmissionError):
                if sealed.reason in (Reason.BANNED_KEY, Reason.UNKNOWN_KEY):
                    m.retired = not (sealed.reason == Reason.BANNED_KEY and self._rejoin(m, at))
                m.free_at = at + IDLE_RETRY_S
            else:
                jobs.append((m, sealed, at))
        return jobs

    def _prefetch(self, jobs: list[tuple[Member, SignedAssignment, float]]) -> None:
        """Generate the plain requests of ``jobs`` (one batch per policy version and sampling).

        Each contributor's share of the batch's time (by rows) is charged to it
        when its strategy takes the group (``Context.generate``); on a real
        network every contributor generates on its own hardware, and here a
        batch is how this machine gets through the same work.
        """
        plain = [
            (m, m.ctx.assignment(sealed)) for m, sealed, _ in jobs if plain_generation(m.strategy)
        ]
        requests = [(a.policy_version, m.ctx.request(a)) for m, a in plain]
        # A request alone in its batch is left to its strategy: nothing to share.
        done = generate_grouped(requests, self._backend, min_batch=2)
        for (m, _), (_, req), got in zip(plain, requests, done, strict=True):
            if got is not None:
                m.ctx.prefetched[req] = got

    def _answer(self, m: Member, sealed: SignedAssignment, at: float) -> None:
        version = open_assignment(
            sealed, self.net.validator.key.public, m.key.public
        ).policy_version
        m.ctx.backend = self._backend(version)
        m.ctx.prefetch_s = 0.0
        start = time.perf_counter()
        body = m.strategy.answer(m.ctx, sealed)
        spent = time.perf_counter() - start + m.ctx.prefetch_s
        m.ctx.prefetched.clear()
        ready = at + self.sim.compute_time(m.spec.id, spent)
        if body is None:  # kept back: the assignment expires unanswered
            m.uploading, m.free_at = free_after(m.uploading, ready, m.spec.uploads)
            return
        delay = self.sim.delay(m.spec.id, "submit")
        # A lost group is given up after IDLE_RETRY_S; the assignment expires unanswered.
        done = ready + (IDLE_RETRY_S if delay is None else delay)
        m.uploading, m.free_at = free_after([*m.uploading, done], ready, m.spec.uploads)
        if delay is not None:
            self.queue.push((m, body, m.key.public.raw), done)

    def _rejoin(self, m: Member, at: float) -> bool:
        """Whitewashing: if ``m``'s strategy comes back after a ban, register a fresh key for
        it (registration is open) and log the new key's first reputation; True if it did."""
        if not rejoins(m.strategy):
            return False
        m.comebacks += 1
        seed = hashlib.sha256(repr(("comeback", m.spec.seed, m.comebacks)).encode()).digest()
        m.key = m.ctx.key = SigningKey.from_seed(seed)
        raw = m.key.public.raw
        self.net.validator.register(raw, f"{m.spec.id}/{m.comebacks}")
        self._registered(m, max(at, self.t))
        return True

    def _registered(self, m: Member, t: float) -> None:
        """Log the reputation ``m``'s current key starts with."""
        raw = m.key.public.raw
        rep = self.net.validator.ledger.reputation(raw)
        self.log.write(
            Reputation(
                t=t,
                run=self.run,
                contributor=m.spec.id,
                strategy=m.spec.strategy,
                score=rep.score,
                banned=rep.banned,
                audit_rate=self.net.validator.ledger.audit_rate(raw),
                key=fingerprint(raw),
            )
        )

    def _audit_rate(self, key: bytes) -> float:
        """The per-rollout rate ``key``'s next group is drawn at (a fixed network rate, or its
        reputation's)."""
        v = self.net.validator
        fixed = v.cfg.rules.audit_rate
        return fixed if fixed >= 0 else v.ledger.audit_rate(key)

    def _deliver_all(self, ready: list[tuple[Member, bytes, bytes]]) -> None:
        """Deliver groups arriving together as one batch (``Validator.admit_many``: their spot
        checks share a forward pass, their verdicts one transaction), in arrival order.

        A group refused with BACKPRESSURE because an earlier group of the batch
        holds its assignment or a completion is delivered again alone right
        after (``Validator.admit_in_turn``), so every outcome is the one of
        delivering one group at a time.
        """
        results = self.net.validator.admit_in_turn([body for _, body, _ in ready])
        for (m, body, key), result in zip(ready, results, strict=True):
            self._deliver(m, result, key, body)

    def _deliver(
        self, m: Member, result: SubmitResult | VerificationError, key: bytes, body: bytes = b""
    ) -> None:
        """Log the verdict on a group ``m`` signed with ``key`` (and any slash and the key's
        reputation), then tell its strategy what a contributor would see (``observe``)."""
        if not isinstance(result, SubmitResult):
            self.log.write(
                VerdictEvent(
                    t=self.t,
                    run=self.run,
                    contributor=m.spec.id,
                    strategy=m.spec.strategy,
                    accepted=False,
                    reason=result.reason.value,
                    audited=False,
                    reward=None,
                    key=fingerprint(key),
                )
            )
            self._feedback(m, key, _assignment_of(body), False, 0, 0, result.reason.value, None)
            return
        verdicts = result.verdicts
        accepted = all(x.accepted for x in verdicts)
        reasons = [
            x.reason for x in verdicts if x.reason and x.reason != Reason.GROUP_REJECTED.value
        ]
        reason = "" if accepted else (reasons[0] if reasons else Reason.GROUP_REJECTED.value)
        self.accepted_samples += sum(x.accepted for x in verdicts)
        self.log.write(
            VerdictEvent(
                t=self.t,
                run=self.run,
                contributor=m.spec.id,
                strategy=m.spec.strategy,
                accepted=accepted,
                reason=reason,
                audited=any(x.audited for x in verdicts),
                reward=sum(x.reward for x in verdicts) / len(verdicts),
                key=fingerprint(key),
            )
        )
        if reason and Reason(reason) in SLASHED:
            self.log.write(
                Slash(
                    t=self.t,
                    run=self.run,
                    contributor=m.spec.id,
                    strategy=m.spec.strategy,
                    reason=reason,
                    key=fingerprint(key),
                )
            )
        audited = sum(x.audited for x in verdicts)
        mean_reward = sum(x.reward for x in verdicts) / len(verdicts)
        aid = verdicts[0].assignment_id if verdicts else b""
        self._feedback(m, key, aid, accepted, audited, len(verdicts), reason, mean_reward)

    def _feedback(
        self,
        m: Member,
        key: bytes,
        assignment_id: bytes,
        accepted: bool,
        audited: int,
        members: int,
        reason: str,
        reward: float | None,
    ) -> None:
        """Log ``key``'s reputation and pass the strategy its :class:`Feedback`; a key banned
        now comes back under a fresh one if the strategy rejoins."""
        v = self.net.validator
        rep = v.ledger.reputation(key)
        rate = self._audit_rate(key)
        self.log.write(
            Reputation(
                t=self.t,
                run=self.run,
                contributor=m.spec.id,
                strategy=m.spec.strategy,
                score=rep.score,
                banned=rep.banned,
                audit_rate=v.ledger.audit_rate(key),
                key=fingerprint(key),
            )
        )
        fb = Feedback(
            assignment_id, accepted, audited, members, reason, reward, rep.score, rate, rep.banned
        )
        observe(m.strategy, m.ctx, fb)
        if rep.banned and key == m.key.public.raw:
            self._rejoin(m, self.t)


def _by_key(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``{fingerprint: value}`` of the metrics named ``<prefix><fingerprint>``."""
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}


class _GroupHead(msgspec.Struct, array_like=True):
    """The first field of a ``GroupSubmission`` (the rest is skipped unparsed)."""

    assignment_id: bytes


def _assignment_of(body: bytes) -> bytes:
    """The assignment id a submission names (b"" when it cannot be read: garbage)."""
    try:
        return msgspec.msgpack.decode(body, type=_GroupHead).assignment_id
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
        return b""


def trainer_config(s: Scenario, model_dir: Path) -> TrainerConfig:
    t, v = s.trainer, s.validator
    return TrainerConfig(
        model_dir=model_dir,
        task=s.task.name,
        steps=t.steps or 1_000_000,
        lr=t.learning_rate,
        lr_schedule=t.lr_schedule,
        warmup_steps=t.warmup_steps,
        min_lr_ratio=t.min_lr_ratio,
        loss=LossSection(name=t.loss.name, params=t.loss.params),
        aggregator=AggregatorSection(name=t.aggregator.name, params=t.aggregator.params),
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
        trained = _train(s, cfg.eval_every, loop, sim, evals, reports, wall0, progress)
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
) -> int:
    """Train until ``s.trainer.steps`` or its wall-clock budget (counted from ``wall0``), each
    step advancing simulated time by its measured duration and logged; versions go to
    ``evals`` as they are due (the last one always), and their reports to ``reports`` as they
    come back. Returns the samples trained."""
    from tqdm import tqdm

    run, log = sim.run, sim.log
    every_version = s.trainer.eval_every_version and s.run == "scenario"
    budget = s.trainer.budget_s or float("inf")
    steps = s.trainer.steps or 1_000_000
    trained, evaluated = 0, 0
    bar = tqdm(total=steps, desc=f"{run:>10}", unit="step", disable=not progress)
    while loop.version < steps and time.monotonic() - wall0 < budget:
        metrics = loop.train_step()
        sim.t += metrics.get("perf/step_s", 0.0)
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
    return trained


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
