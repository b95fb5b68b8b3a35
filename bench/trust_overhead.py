"""What the trust layer costs: prooftrain with it against the same loop without it, and TRL.

Two figures, each a ratio of completions trained per wall-clock second:

* ``trust_ratio`` = trust-on / trust-off: prooftrain's whole system against the
  same RL loop with the trust layer off (``bench/_trust_off.py``), same
  process layout, model, generation engine, batches, loss, optimizer and steps;
* ``trl_ratio`` = prooftrain (trust on, shared prefill off) / TRL's
  ``GRPOTrainer``, both prefilling every completion's prompt, so the figure
  compares trainers rather than generation engines (prooftrain's
  ``TransformersBackend`` otherwise prefills each prompt once for its G
  completions; TRL prefills every row). Each side's generation seconds per
  step are reported beside it.

Every side trains the demo base model (``trainer.base_model.ensure_base_model``)
on the reverse-text task (``--task``) with the same batch (``groups`` prompts x
``group_size`` completions per optimizer step), the same completion length,
sampling (temperature 1, no top-k / top-p), learning rate, gradient clip and
reward function (``rewards.reward``), the same prompt tokens (a model whose
tokenizer has a chat template gets each prompt as one user message, rendered
by that template), no KL term, one optimizer step per generated batch, float32
on the CPU with one torch thread each. Each side runs in its own Python
process. A round runs trust on and trust off, then, with TRL installed,
prooftrain with its prefill unshared and TRL; every round's figures and the
machine's load averages (``os.getloadavg``) before and after each side are in
the JSON (``trust_rounds``). By default trust on and
trust off run as two processes at once that take turns (``interleaved``): each
loads and warms up, then they run their timed steps one at a time, alternately
(the pair's order swaps every step), so load that comes and goes falls on both
sides alike and the verdict does not depend on when the machine was busy; each
round says it ran no two timed steps together (``overlapping_steps``, from each
step's interval on the system-wide monotonic clock) and that they alternated
(``steps_alternated``). That needs both sides' memory at once
(:func:`interleave_refusal`: about ``(240 + 4 x contributors)`` bytes a
parameter, against the memory available); where it does not fit (SmolLM2-135M
on a 24 GB machine), or with ``--no-interleave``, the two run one after the
other, and ``interleave_skipped`` says why. Which side goes first alternates
from round to round either way, and the default, 4 rounds, lets each go first
equally often, so an order effect cannot favour either side.

Which figure counts (``trust_ratio_rule``): where the sides took turns, the
median of the rounds' ratios, each round comparing the two under the same load
(the best round of each side would pair rounds run at different times and
undo that); where they ran one after the other, the best round of each side,
the one least disturbed by other load on a shared machine. Both figures are in
the JSON either way (``trust_ratio_median_of_rounds``,
``trust_ratio_best_of_sides``). TRL and the unshared side count their best round.

* trust on (prooftrain): the harness's in-process network (``harness.run.run_variant``)
  with ``contributors`` honest contributors on an instantaneous network (zero
  latency, no jitter, no drops, compute speed 1) and the validator at its
  default, reputation-driven audit rate and a deployment's assignment TTL
  (``ASSIGNMENT_TTL_S``). Every rollout is signed, admitted,
  scored by the validator, spot-checked when drawn and recorded in the ledger;
  the trainer aggregates one gradient per contributor robustly and publishes a
  signed, compressed update every step, whose decoded copy the contributors
  sample from and the spot checks recompute under (the in-process network
  decodes it once for everyone). The contributors share this machine: those
  that start work at the same moment generate in one batch (each row with its
  own contributor's sampler noise, as on its own hardware), and groups that
  arrive together are admitted together (``Validator.admit_many``: one
  spot-check pass, one ledger transaction), as a busy node batches concurrent
  submissions. Timed: the trainer's ``train_step`` calls, which contain all of
  that (contributors generate inside the trainer's wait). Not timed: model
  loading, the held-out evals the harness runs before the first and after the
  last step (the eval interval is set past the run so none falls in between),
  the final offline ledger audit and the harness's own event logging. Groups
  whose rewards are all equal are trained on (``skip_uniform_groups`` off), as
  TRL does, so every side puts the same completions through every step.
* trust off: the same ``TrainerLoop`` and ``PipelineRunner`` built from the same
  scenario, generating each step's groups with the same engine
  (``TransformersBackend.generate_batch``: one batch, shared prefill, the
  keyed sampler) on the trainer's own parameters, with no signing or
  verification, no admission, spot checks, reputation or ledger, one plain
  mean-gradient pass under the same loss (no per-contributor gradients, no
  robust aggregation) and no publication (``bench/_trust_off.py``). Timed: its
  ``train_step`` calls. It counts its groups, passes and steps, and both
  prooftrain sides count their calls of the trust layer's functions
  (``TRUST_CALLS``: signing, signature checks, admission, ledger appends,
  per-contributor gradient hooks, aggregation, publication), so the JSON shows
  that the trust-off side made none.
* TRL: ``GRPOTrainer`` without vLLM, ``num_generations = group_size``,
  ``per_device_train_batch_size = groups * group_size``, one gradient
  accumulation step, ``beta = 0``, ``num_iterations = 1``, and no activation
  (gradient) checkpointing, which ``GRPOConfig`` turns on by default and which
  prooftrain does not do. Timed: from the end of one optimizer step to the end
  of the next (generation, rewards, the step); its generation seconds are the
  model's ``generate`` calls.

Each side's first steps are a warm-up and are not counted; the figure is
completions trained per wall-clock second over the ``steps`` after them. A
deployment's first steps audit every completion: a new key is on probation
(audited at rate 1) for ``ledger.reputation.PROBATION_ROLLOUTS`` audited
completions, a cost paid once per key. So prooftrain's side warms up until every
contributor is off probation (``--warmup-steps steady``, the default: 5 steps at
the defaults) and its timed steps see the reputation-driven rate that follows
(about 0.16 per completion just after probation, falling towards about 0.09 as
evidence accumulates; the JSON's ``audit_rate_timed``, the mean of the rates the
validator's keyed draws applied to the timed steps' completions, as the ledger
records them); the sides
without contributors (trust off, TRL) warm up ``--baseline-warmup-steps``
(default 1). ``--warmup-steps N`` times prooftrain from step N + 1 instead,
probation included. The JSON's ``audited_share`` is the share of groups
with a completion spot-checked during the timed steps, and each side's token positions per step
show that both trained batches of the same shape.
Prints progress on stderr and one JSON object on the last line of stdout:

  trust_ratio                                    trust_on / trust_off samples per second:
                                                 the median of the rounds' ratios where the
                                                 sides took turns, else the best round of
                                                 each (trust_ratio_rule says which;
                                                 trust_ratio_baseline what the baseline is)
  trust_rounds                                   per round: which side went first, each
                                                 side's rate, CPU per wall second and load
                                                 before/after, the ratio, overlapping_steps
                                                 and steps_alternated
  trust_ratio_median_of_rounds                   the median of the rounds' ratios
  trust_ratio_best_of_sides                      trust on's best round over trust off's
  interleaved                                    the sides took turns step by step
  interleave_skipped                             why they ran one after the other instead
  order_balanced                                 each side went first in half the rounds
  trust_on_cpu_per_wall, trust_off_cpu_per_wall  CPU seconds (all threads) per wall second
                                                 over the timed steps (about 1: one core)
  trust_on_phases_s / trust_off_phases_s         seconds per timed step of each phase
                                                 (exclusive; ``other`` is the rest of the step)
  trust_on_calls / trust_off_calls               calls of the trust layer's functions
  trust_on_tokens_per_step, ..._real_...         token positions per timed step through the
                                                 RL forward and backward (padded; real),
                                                 each side (the same batch shape)
  trust_off_counts                               the trust-off side's groups, samples,
                                                 passes and steps
  audit_rate_mean                                mean spot-check probability the validator's
                                                 draw applied per completion (reputation-
                                                 driven, whole run; from the ledger's verdicts)
  audit_rate_timed                               the same over the completions judged after
                                                 the warm-up's last version was published
  audited_completions_timed                      the share of those completions spot-checked
  audited_share                                  groups with a completion spot-checked /
                                                 groups judged, during the timed steps
  warmup_steps, baseline_warmup_steps            untimed steps before them (prooftrain;
                                                 trust off and TRL)
  trl_ratio, trl_ratio_baseline                  prooftrain (prefill unshared) / TRL
  unshared_generation_s_per_step,
  trl_generation_s_per_step                      each side's generation seconds per step
  *_peak_rss_mib, *_train_reward_mean            peak resident memory; mean trained reward

``--scaling`` runs that comparison at three sizes in one run (the demo base
model; a random-init Llama, hidden 384, 6 layers, 14M parameters; SmolLM2-135M
from ``--smollm2-dir`` or where ``prooftrain models fetch smollm2-135m`` puts
it, skipped with the reason when absent), with ``--scaling-steps`` and
``--scaling-rounds`` per size (defaults 80,12,10 steps and 4 rounds each; a
demo step takes about a fifth of a second, so 80 give each side of a round
about 15 s), then measures the default aggregator's extra peak memory on (n, d)
rows at two contributor counts (``bench/_phases.py``). Its JSON line holds
``sizes`` (each size's figures as above, plus ``params`` and
``trust_ratio_target``), ``trust_ratios``, ``trl_ratios``,
``trl_ratio_holds_with_size`` and ``aggregation_memory``.

The task is reverse-text because its reward is partial credit (edit-distance
similarity to the reversed string): every model, a random-init one included,
earns rewards that differ inside a group, so every advantage and every gradient
is real and every side does the full work of an RL step at every size.

TRL is a bench-only dependency (``pip install '.[bench]'``); without it the
TRL figures are null and ``skipped`` says why (the trust ratio is measured
regardless).

With ``--pass-per-contributor`` prooftrain's RL step runs one forward and
backward pass per contributor (its fallback) instead of one pass for all
(``trainer.groupgrad``), to measure what the one-pass gradients buy. With
``--gram-sketch W`` its aggregator works from a random W x W sketch of each
weight matrix's per-contributor gradient (the trainer's
``aggregator.gram_sketch``; the JSON's ``gram_sketch``). ``--keep-gib G`` gives
its one pass G GiB for per-contributor gradient rows (the trainer's
``aggregator.keep_gib``, whose default is 1): rows beyond the budget are formed
twice. By default the bench gives it every contributor's rows of the model
(contributors x parameters x 4 bytes rounded up to whole GiB, plus 1), as an
operator with the memory would: 6 GiB for SmolLM2-135M with 8 contributors. The
JSON's ``keep_gib`` is the budget used.

    python bench/trust_overhead.py [--steps 20] [--warmup-steps steady|N] [--rounds 4] [--groups 8] [--group-size 8]
                                   [--max-tokens 8] [--contributors 8] [--pass-per-contributor]
                                   [--gram-sketch W] [--no-interleave]
    python bench/trust_overhead.py --scaling [--smollm2-dir DIR] [--scaling-steps 80,12,10]
                                   [--scaling-rounds 4,4,4] [--no-interleave]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._phases import PhaseClock, Target, aggregation_peak, peak_rss_mib, per_step  # noqa: E402
from bench._trl import SEED, pool_size, reward_fn, run_trl, trl_prompt  # noqa: E402, F401
from bench._util import emit  # noqa: E402
from rollout.loading import model_dir_arg  # noqa: E402

RATIO_TARGET = 0.8
"""TRL ratio target (prooftrain with its prefill unshared / TRL)."""
TRUST_TARGETS = {"demo": None, "14m": 0.85, "smollm2-135m": 0.9}
"""trust_ratio targets per ``--scaling`` size (issue 49)."""
TRUST_BASELINE = (
    "prooftrain with the trust layer off (bench/_trust_off.py): the same trainer loop, model, "
    "generation engine (shared prefill), batch shape, loss, optimizer and steps, with no "
    "signing, admission, spot checks, per-contributor gradients, robust aggregation, "
    "publication or ledger"
)
TRL_BASELINE = (
    "TRL GRPOTrainer; prooftrain (trust on) with its shared prefill off "
    "(TransformersBackend(share_prefill=False)): both sides prefill every completion's prompt"
)
TASK = "reverse_text"
PAIRED_RULE = (
    "median of the rounds' ratios (the sides took turns step by step, so each round "
    "compares them under the same load)"
)
SEQUENCE_RULE = "best round of each side (the sides ran one after the other)"
TRL_MISSING = "trl not installed (pip install '.[bench]')"

SCENARIO = """
name = "trust-overhead"
seed = {seed}
[task]
name = "{task}"
train_pool = {pool}
heldout = 1
[[population.groups]]
strategy = "honest"
count = {contributors}
[network.profiles.default]
latency = {{ model = "constant", params = {{ ms = 0 }} }}
jitter_ms = 0
compute_speed = 1.0
[validator]
group_size = {group_size}
max_tokens = {max_tokens}
temperature = 1.0
assignment_ttl_s = {ttl_s}
[trainer]
steps = {total_steps}
batch_groups = {groups}
learning_rate = {lr}
gram_sketch = {gram_sketch}
keep_gib = {keep_gib}
eval_every = 1000000
eval_problems = 1
[baselines]
run_honest_baseline = false
run_no_defence = false
"""
ASSIGNMENT_TTL_S = 600.0
"""The validator's ``assignment.ttl_s`` on prooftrain's side: a deployment's default. The
harness's own 30 s is sized for the demo model's fifth-of-a-second steps; a SmolLM2-135M
step takes about 30 s on one core, and 30 s would expire the assignment each contributor
fetched ahead while the trainer's first step ran, recorded as abandoned: evidence against
honest contributors that raised their audit rate, and the spot checks' cost, by a third."""

MODEL_DIR = """[model]
dir = "{model_dir}"
"""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """Replace ``module.name`` for the duration of the block."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# -- prooftrain ---------------------------------------------------------------------------


def phase_targets() -> list[Target]:
    """The calls that make up each phase of prooftrain's step (timed exclusively: a call
    nested in another counts towards its own phase only)."""
    import torch

    import harness.adversaries.base as strategies
    import harness.run as hrun
    import harness.simulation as sim
    import trainer.rl as rl
    from trainer.groupgrad import GroupGradients
    from trainer.pipeline import PipelineRunner

    return [
        ("generation", sim.Simulation, "_prefetch"),
        ("generation", sim.Simulation, "_answer"),
        ("signing", strategies, "sign_completions"),
        ("admission_and_spot_checks", sim.Simulation, "_deliver_all"),
        ("rl_forward_backward", PipelineRunner, "forward_backward"),
        ("per_contributor_gradients", GroupGradients, "_linear"),
        ("per_contributor_gradients", GroupGradients, "_embedding"),
        ("per_contributor_gradients", GroupGradients, "_rmsnorm"),
        ("per_contributor_gradients", GroupGradients, "reset"),
        ("per_contributor_gradients", GroupGradients, "gram"),
        ("per_contributor_gradients", rl, "flat_grad"),
        ("aggregation", rl.RLStep, "_apply"),
        ("aggregation", GroupGradients, "combine"),
        ("aggregation", rl.RLStep, "_finish"),
        ("optimizer_step", torch.optim.AdamW, "step"),
        ("publication", hrun.LocalNetwork, "publish"),
    ]


TRUST_CALLS: list[tuple[str, str, str]] = [
    ("sign", "verify.keys:SigningKey", "sign"),
    ("verify_signature", "verify.keys:PublicKey", "verify"),
    ("admit", "node.validator.core:Validator", "admit_many"),
    ("ledger_append", "ledger.log:Ledger", "append_many"),
    ("per_contributor_gradients", "trainer.groupgrad:GroupGradients", "_on_grad"),
    ("aggregate", "trainer.rl:RLStep", "_finish"),
    ("publish", "trainer.publish:StagePublisher", "update"),
]
"""Calls that only the trust layer makes, counted on both sides: (name, owner, attribute)."""


class TrainedTokens:
    """Token positions each side puts through its RL forward and backward passes: padded
    (``input_ids`` entries) and real (``attention_mask`` ones), so the JSON shows that
    both sides trained batches of the same shape."""

    def __init__(self) -> None:
        self.padded = self.real = 0

    def installed(self) -> contextlib.AbstractContextManager[None]:
        from trainer.pipeline import PipelineRunner

        real_fn = PipelineRunner.forward_backward

        def counted(runner: Any, batch: Any, loss_fn: Any) -> Any:
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            self.padded += int(ids.numel())
            self.real += int(mask.sum()) if mask is not None else int(ids.numel())
            return real_fn(runner, batch, loss_fn)

        return patched(PipelineRunner, "forward_backward", counted)

    def snapshot(self) -> tuple[int, int]:
        return self.padded, self.real


class Turns:
    """A side's half of an interleaved round (``--interleave``; ``--turns R,W`` names its
    pipe ends): before each timed step, and after the last, the side says it is idle (one
    byte on W) and waits for its turn (one byte on R). The driver gives one side a step at a
    time, so load that comes and goes falls on both sides alike. Without ``--turns`` every
    call returns at once. Each timed step's interval on the system-wide monotonic clock goes
    in the side's JSON (``step_intervals``), so a run can show that no two steps overlapped,
    and so do the process's CPU seconds over the timed steps (``cpu_s``: every thread's)"""

    def __init__(self, spec: str | None, warmup: int, steps: int) -> None:
        self.fds = tuple(int(x) for x in spec.split(",")) if spec else None
        self.warmup, self.last = warmup, warmup + steps
        self.intervals: list[tuple[float, float]] = []
        self.cpu_s = 0.0

    def step(self, train_step: Callable[[], Any], durations: list[float]) -> Any:
        """Run ``train_step`` in its turn, append its seconds to ``durations`` (the side's
        steps so far) and return what it returned."""
        timed = self.warmup <= len(durations) < self.last
        if timed:
            self._idle()
        began, start, cpu = time.monotonic(), time.perf_counter(), time.process_time()
        metrics = train_step()
        durations.append(time.perf_counter() - start)
        if timed:
            self.intervals.append((began, time.monotonic()))
            self.cpu_s += time.process_time() - cpu
        if len(durations) == self.last:
            self._idle()
        return metrics

    def _idle(self) -> None:
        if self.fds is None:
            return
        go, idle = self.fds
        os.write(idle, b".")
        if os.read(go, 1) != b".":
            raise SystemExit("the bench's driver is gone")


def trust_targets() -> list[Target]:
    import importlib

    out: list[Target] = []
    for name, owner, attr in TRUST_CALLS:
        module, _, cls = owner.partition(":")
        out.append((name, getattr(importlib.import_module(module), cls), attr))
    return out


def write_scenario(args: argparse.Namespace, work: Path) -> Any:
    """The run's scenario (both prooftrain sides read it), loaded."""
    from harness.scenario import load_scenario

    path = work / "scenario.toml"
    path.write_text(
        SCENARIO.format(
            seed=SEED,
            task=args.task,
            pool=pool_size(args),
            contributors=args.contributors,
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            total_steps=args.steps + args.warmup_steps,
            groups=args.groups,
            lr=args.lr,
            gram_sketch=args.gram_sketch,
            keep_gib=args.keep_gib,
            ttl_s=ASSIGNMENT_TTL_S,
        )
        + (MODEL_DIR.format(model_dir=Path(args.model_dir).resolve()) if args.model_dir else "")
    )
    return load_scenario(path)


def unshared_backend(on: bool) -> contextlib.AbstractContextManager[None]:
    """With ``on``, the simulation's contributors prefill each completion's prompt on its own
    (``TransformersBackend(share_prefill=False)``), as TRL's generation does."""
    import functools

    import harness.simulation as sim
    from rollout.backends import TransformersBackend

    if not on:
        return contextlib.nullcontext()
    return patched(
        sim, "TransformersBackend", functools.partial(TransformersBackend, share_prefill=False)
    )


def run_prooftrain(args: argparse.Namespace, work: Path) -> dict:
    """The trust-on side: the harness's in-process network (see the module docstring)."""
    import harness.run as hrun
    from harness.events import EVENTS_FILE, EventLog, Verdict, read_events
    from trainer.groupgrad import GroupGradients

    durations: list[float] = []
    samples: list[int] = []
    rewards: list[float] = []
    clock, calls = PhaseClock(), PhaseClock()
    after_warmup: dict[str, float] = {}
    warmup = args.warmup_steps
    tokens, tokens_at_warmup = TrainedTokens(), [(0, 0)]
    sims: list[Any] = []
    timed_from: list[float] = []  # simulated time at the end of the warm-up

    turns = Turns(args.turns, warmup, args.steps)

    class TimedLoop(hrun.TrainerLoop):
        def train_step(self):  # noqa: ANN202 - same signature as the base
            metrics = turns.step(super().train_step, durations)
            samples.append(int(metrics.get("train/samples", 0)))
            rewards.append(float(metrics.get("train/reward", 0.0)))
            if len(durations) == warmup:
                after_warmup.update(clock.snapshot())
                tokens_at_warmup[0] = tokens.snapshot()
                timed_from.append(sims[0].t)
            return metrics

    class SeenSimulation(hrun.Simulation):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            sims.append(self)

    def config(s, model_dir):  # noqa: ANN001, ANN202
        return base_config(s, model_dir).model_copy(update={"skip_uniform_groups": False})

    base_config = hrun.trainer_config
    scenario = write_scenario(args, work)
    log_path = work / EVENTS_FILE
    start = time.perf_counter()
    fallback = (
        patched(GroupGradients, "plan", lambda module, params: None)
        if args.pass_per_contributor
        else contextlib.nullcontext()
    )
    with (
        patched(hrun, "TrainerLoop", TimedLoop),
        patched(hrun, "Simulation", SeenSimulation),
        patched(hrun, "trainer_config", config),
        tokens.installed(),
        fallback,
        unshared_backend(args.unshared_prefill),
        clock.installed(phase_targets()),
        calls.installed(trust_targets()),
        EventLog(log_path) as log,
    ):
        values = hrun.run_variant(scenario, work / "run", log, progress=args.progress, say=say)
        timed = clock.snapshot()
    total = time.perf_counter() - start
    events = read_events(log_path)
    judged = [  # the timed steps' group verdicts
        e.audited for e in events if isinstance(e, Verdict) and timed_from and e.t > timed_from[0]
    ]
    rate_mean, _ = drawn_rates(Path(values["ledger"]), 0)
    rate_timed, audited_timed = drawn_rates(Path(values["ledger"]), warmup)
    return {
        **_timed(samples, durations, rewards, warmup, after_warmup, timed),
        "total_wall_s": total,
        "audit_ok": values["audit_ok"],
        "audit_rate_mean": rate_mean,
        "audit_rate_timed": rate_timed,
        "audited_completions_timed": audited_timed,
        "audited_share": _mean(judged),
        **_tokens_per_step(tokens, tokens_at_warmup[0], len(durations) - warmup),
        "verdicts": sum(isinstance(e, Verdict) for e in events),
        "trust_calls": dict(calls.calls),
        "step_intervals": turns.intervals,
        "cpu_s": turns.cpu_s,
    }


def drawn_rates(ledger: Path, after_version: int) -> tuple[float | None, float | None]:
    """(mean audit rate, share audited) of the completions a validator drew for after policy
    version ``after_version`` was published (0: the whole run; None, None when there are
    none), read from ``ledger``: each completion's verdict records the rate its keyed draw
    applied (``DrawnVerdict.audit_rate``) and whether a spot check ran, so both are per
    completion, as the spot checks' cost is. A verdict drawn with no completion (an
    abandoned or discarded assignment's own draw) and one recorded at rate 0 (a member of
    a group that failed before its draw) are left out."""
    from ledger.records import DrawnVerdict, PolicyPublished, decode_record
    from ledger.storage import open_store

    store = open_store(str(ledger), readonly=True)
    rates: list[float] = []
    audited: list[bool] = []
    started = after_version == 0
    try:
        for _, _, body in store.entries(0, None):
            record = decode_record(body)
            if isinstance(record, PolicyPublished) and record.version == after_version:
                started = True
            elif started and isinstance(record, DrawnVerdict):
                if record.completion and record.audit_rate > 0:
                    rates.append(record.audit_rate)
                    audited.append(record.audited)
    finally:
        store.close()
    return _mean(rates), _mean(audited)


def _mean(values: list[float] | list[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def _tokens_per_step(tokens: TrainedTokens, at_warmup: tuple[int, int], steps: int) -> dict:
    padded, real = (now - then for now, then in zip(tokens.snapshot(), at_warmup, strict=True))
    return {
        "tokens_per_step": round(padded / max(1, steps), 1),
        "real_tokens_per_step": round(real / max(1, steps), 1),
    }


def _timed(
    samples: list[int],
    durations: list[float],
    rewards: list[float],
    warmup: int,
    after_warmup: dict[str, float],
    timed: dict[str, float],
) -> dict:
    """A side's figures over the steps after its ``warmup`` steps."""
    steps, wall = len(durations) - warmup, sum(durations[warmup:])
    return {
        "samples": sum(samples[warmup:]),
        "wall_s": wall,
        "warmup_s": sum(durations[:warmup]),
        "steps": steps,
        "phases_s": per_step(after_warmup, timed, steps, wall),
        "peak_rss_mib": peak_rss_mib(),
        "train_reward_mean": sum(rewards[warmup:]) / max(1, steps),
    }


def trust_off_targets() -> list[Target]:
    """The phases of the trust-off side's step (``bench/_trust_off.py``)."""
    import torch

    from bench._trust_off import PlainSource
    from rollout.backends import TransformersBackend
    from trainer.pipeline import PipelineRunner

    return [
        ("generation", TransformersBackend, "generate_batch"),
        ("generation", TransformersBackend, "generate"),
        ("scoring", PlainSource, "_produce"),
        ("rl_forward_backward", PipelineRunner, "forward_backward"),
        ("optimizer_step", torch.optim.AdamW, "step"),
    ]


def run_trust_off(args: argparse.Namespace, work: Path) -> dict:
    """The trust-off side: the same loop with the trust layer out (``bench/_trust_off.py``)."""
    from dataclasses import asdict

    import harness.run as hrun
    from bench._trust_off import plain_loop

    scenario = write_scenario(args, work)
    model_dir = scenario.model.ensure(scenario.task.name, progress=args.progress)
    cfg = hrun.trainer_config(scenario, model_dir).model_copy(update={"skip_uniform_groups": False})
    clock, calls = PhaseClock(), PhaseClock()
    durations: list[float] = []
    samples: list[int] = []
    rewards: list[float] = []
    after_warmup: dict[str, float] = {}
    tokens, tokens_at_warmup = TrainedTokens(), (0, 0)
    start = time.perf_counter()
    with (
        tokens.installed(),
        clock.installed(trust_off_targets()),
        calls.installed(trust_targets()),
    ):
        loop, counts = plain_loop(scenario, cfg, model_dir, share_prefill=not args.unshared_prefill)
        turns = Turns(args.turns, args.warmup_steps, args.steps)
        for _ in range(cfg.steps):
            metrics = turns.step(loop.train_step, durations)
            samples.append(int(metrics.get("train/samples", 0)))
            rewards.append(float(metrics.get("train/reward", 0.0)))
            if len(durations) == args.warmup_steps:
                after_warmup.update(clock.snapshot())
                tokens_at_warmup = tokens.snapshot()
        timed = clock.snapshot()
    return {
        **_timed(samples, durations, rewards, args.warmup_steps, after_warmup, timed),
        "total_wall_s": time.perf_counter() - start,
        "counts": asdict(counts),
        "trust_calls": dict(calls.calls),
        **_tokens_per_step(tokens, tokens_at_warmup, len(durations) - args.warmup_steps),
        "step_intervals": turns.intervals,
        "cpu_s": turns.cpu_s,
    }


# -- driver -------------------------------------------------------------------------------

SIDES = {"prooftrain": run_prooftrain, "trust_off": run_trust_off, "trl": run_trl}


def build_wide_model(width: int, layers: int, out: Path, task: str = TASK) -> Path:
    """A random-init Llama of ``width`` x ``layers`` sharing the ``task`` demo base model's
    tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.base_model import ensure_base_model

    base = ensure_base_model(task, SEED, progress=False)
    cfg = LlamaConfig.from_pretrained(base)
    heads = max(1, width // 32)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = width, 4 * width, layers
    cfg.num_attention_heads = cfg.num_key_value_heads = heads
    cfg.head_dim = width // heads
    torch.manual_seed(SEED)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return out


def side_command(side: str, args: argparse.Namespace, unshared: bool = False) -> list[str]:
    """The command line of one side's process (``unshared``: prooftrain generates with its
    shared prefill off); says what it will run."""
    warmup = side_warmup(side, args)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--steps",
        str(args.steps),
        "--warmup-steps",
        str(warmup),
        "--groups",
        str(args.groups),
        "--group-size",
        str(args.group_size),
        "--max-tokens",
        str(args.max_tokens),
        "--contributors",
        str(args.contributors),
        "--lr",
        str(args.lr),
        "--task",
        args.task,
    ]
    if args.model_dir:
        cmd += ["--model-dir", str(Path(args.model_dir).resolve())]
    if args.pass_per_contributor:
        cmd.append("--pass-per-contributor")
    if args.gram_sketch:
        cmd += ["--gram-sketch", str(args.gram_sketch)]
    cmd += ["--keep-gib", str(args.keep_gib)]
    if unshared:
        cmd.append("--unshared-prefill")
    if not args.progress:
        cmd.append("--quiet")
    say(
        f"{side}{' (prefill unshared)' if unshared else ''}: {args.steps} + "
        f"{warmup} warm-up steps "
        f"of {args.groups} x {args.group_size} completions"
    )
    return cmd


def run_side(side: str, args: argparse.Namespace, unshared: bool = False) -> dict:
    """Run one side in a fresh Python process; its figures come back as its last stdout line,
    with the machine's load averages just before and just after (``os.getloadavg``)."""
    before = load()
    cmd = side_command(side, args, unshared)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout
    return _side_result(side, args, out, before, unshared)


def _side_result(
    side: str, args: argparse.Namespace, out: str, before: list[float], unshared: bool = False
) -> dict:
    result = json.loads(out.strip().splitlines()[-1])
    result.update(load_before=before, load_after=load())
    # Each side's figures as they come (a run killed later still leaves them on stderr).
    say(f"{side} done: {json.dumps({**result, 'unshared': unshared, 'model': args.model_dir})}")
    return result


def run_interleaved(args: argparse.Namespace, first: str) -> tuple[dict, dict]:
    """Trust on and trust off as two processes at once, taking turns (``Turns``): each
    loads and warms up, then they run their timed steps one at a time, alternately (``first``
    begins, and the pair's order swaps every step), so the machine's load falls on both
    alike. Both hold their model at once: twice the memory of a sequential round."""
    names = {"trust_on": "prooftrain", "trust_off": "trust_off"}
    before = load()
    procs: dict[str, tuple[subprocess.Popen, int, int, Any]] = {}
    try:
        for key, side in names.items():
            go_r, go_w = os.pipe()
            idle_r, idle_w = os.pipe()
            out = tempfile.TemporaryFile("w+")
            cmd = side_command(side, args) + ["--turns", f"{go_r},{idle_w}"]
            proc = subprocess.Popen(cmd, stdout=out, text=True, cwd=ROOT, pass_fds=(go_r, idle_w))
            os.close(go_r)
            os.close(idle_w)
            procs[key] = (proc, go_w, idle_r, out)

        def turn(key: str, go: bool = True) -> None:
            proc, go_w, idle_r, _ = procs[key]
            if go:
                os.write(go_w, b".")
            if os.read(idle_r, 1) != b".":
                raise RuntimeError(f"{names[key]} side exited with {proc.wait()} mid-round")

        for key in procs:
            turn(key, go=False)  # loaded and warmed up
        other = "trust_off" if first == "trust_on" else "trust_on"
        for step in range(args.steps):
            for key in (first, other) if step % 2 == 0 else (other, first):
                turn(key)
        for _, go_w, _, _ in procs.values():
            os.write(go_w, b".")  # finish: each side's untimed end runs now
        results = []
        for key, (proc, _, _, out) in procs.items():
            if proc.wait() != 0:
                raise subprocess.CalledProcessError(proc.returncode, names[key])
            out.seek(0)
            results.append(_side_result(names[key], args, out.read(), before))
        return results[0], results[1]
    finally:
        for proc, go_w, idle_r, out in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for fd in (go_w, idle_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
            out.close()


def load() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def rate(side: dict) -> float:
    return side["samples"] / side["wall_s"]


def _round_entry(r: int, first: str, on: dict, off: dict) -> dict:
    return {
        "round": r + 1,
        "first": first,
        "trust_on_samples_per_s": round(rate(on), 2),
        "trust_off_samples_per_s": round(rate(off), 2),
        "trust_ratio": round(rate(on) / rate(off), 3),
        "trust_on_cpu_per_wall": _cpu_per_wall(on),
        "trust_off_cpu_per_wall": _cpu_per_wall(off),
        "trust_on_load": {"before": on.get("load_before"), "after": on.get("load_after")},
        "trust_off_load": {"before": off.get("load_before"), "after": off.get("load_after")},
        "overlapping_steps": overlaps(on.get("step_intervals", []), off.get("step_intervals", [])),
        "steps_alternated": alternated(on.get("step_intervals", []), off.get("step_intervals", [])),
    }


def alternated(a: list[list[float]], b: list[list[float]]) -> bool:
    """Whether the two sides' timed steps, in the order they started, alternate in pairs
    (each pair one step of each side, in either order): what an interleaved round runs."""
    order = [side for _, side in sorted([(x[0], 0) for x in a] + [(x[0], 1) for x in b])]
    pairs = [order[i : i + 2] for i in range(0, len(order), 2)]
    return bool(order) and len(a) == len(b) and all(sorted(p) == [0, 1] for p in pairs)


def overlaps(a: list[list[float]], b: list[list[float]]) -> int:
    """Pairs of timed steps, one of each side, whose intervals overlap (0 when the sides
    took turns or ran one after the other)."""
    return sum(1 for s, e in a for s2, e2 in b if s < e2 and s2 < e)


def summarise(
    args: argparse.Namespace,
    ons: list[dict],
    offs: list[dict],
    trls: list[dict],
    unshared: list[dict],
    skipped: str | None,
) -> dict:
    """The trust ratio (trust-on / trust-off: the median of the rounds' ratios where the sides
    took turns, each round comparing them under the same load; otherwise each side's best
    round, the one least disturbed by other load on the machine), every round's figures and
    load, then the TRL ratio (prooftrain with its prefill unshared against TRL, best rounds)
    when TRL ran. The phases, rates and memory reported are each side's best round's."""
    on, off = max(ons, key=rate), max(offs, key=rate)
    size = getattr(args, "size", None)
    rounds = [
        _round_entry(r, getattr(args, "order", ["trust_on"] * len(ons))[r], a, b)
        for r, (a, b) in enumerate(zip(ons, offs, strict=True))
    ]
    median = statistics.median(x["trust_ratio"] for x in rounds)
    best = rate(on) / rate(off)
    paired = bool(getattr(args, "interleave", False))
    audited = on.get("audit_rate_mean")
    trl = max(trls, key=rate) if trls else None
    pu = max(unshared, key=rate) if unshared else None
    result = {
        "bench": "trust_overhead",
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "baseline_warmup_steps": args.baseline_warmup_steps,
        "rounds": args.rounds,
        "batch_completions": args.groups * args.group_size,
        "groups": args.groups,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "contributors": args.contributors,
        "threads": 1,
        "model": args.model_dir or "demo base model",
        "task": args.task,
        "trust_ratio": round(median if paired else best, 3),
        "trust_ratio_target": TRUST_TARGETS.get(size) if size else None,
        "trust_ratio_baseline": TRUST_BASELINE,
        "trust_ratio_rule": PAIRED_RULE if paired else SEQUENCE_RULE,
        "trust_ratio_median_of_rounds": round(median, 3),
        "trust_ratio_best_of_sides": round(best, 3),
        "trust_rounds": rounds,
        "interleaved": paired,
        "interleave_skipped": getattr(args, "interleave_skipped", None),
        "order_balanced": _balanced([x["first"] for x in rounds]),
        "trust_on_samples_per_s": round(rate(on), 2),
        "trust_off_samples_per_s": round(rate(off), 2),
        "trust_on_wall_s": round(on["wall_s"], 2),
        "trust_off_wall_s": round(off["wall_s"], 2),
        "trust_on_cpu_per_wall": _cpu_per_wall(on),
        "trust_off_cpu_per_wall": _cpu_per_wall(off),
        "trust_on_phases_s": on.get("phases_s"),
        "trust_off_phases_s": off.get("phases_s"),
        "trust_on_calls": on.get("trust_calls"),
        "trust_off_calls": off.get("trust_calls"),
        "trust_off_counts": off.get("counts"),
        "trust_on_verdicts": on.get("verdicts"),
        "trust_on_tokens_per_step": on.get("tokens_per_step"),
        "trust_off_tokens_per_step": off.get("tokens_per_step"),
        "trust_on_real_tokens_per_step": on.get("real_tokens_per_step"),
        "trust_off_real_tokens_per_step": off.get("real_tokens_per_step"),
        "trust_on_peak_rss_mib": on.get("peak_rss_mib"),
        "trust_off_peak_rss_mib": off.get("peak_rss_mib"),
        "trust_on_train_reward_mean": _r4(on.get("train_reward_mean")),
        "trust_off_train_reward_mean": _r4(off.get("train_reward_mean")),
        "audit_rate": "reputation (validator default)",
        "audit_rate_mean": None if audited is None else round(audited, 4),
        "audit_rate_timed": _r4(on.get("audit_rate_timed")),
        "audited_completions_timed": _r4(on.get("audited_completions_timed")),
        "audited_share": _r4(on.get("audited_share")),
        "ledger_audit_ok": all(p["audit_ok"] for p in ons + unshared),
        "contributor_gradients": (
            "a pass per contributor" if args.pass_per_contributor else "one pass for all"
        ),
        "gram_sketch": args.gram_sketch,
        "keep_gib": args.keep_gib,
        "trl_ratio": None if trl is None or pu is None else round(rate(pu) / rate(trl), 3),
        "trl_ratio_target": RATIO_TARGET,
        "trl_ratio_baseline": TRL_BASELINE,
        "trl_samples_per_s": None if trl is None else round(rate(trl), 2),
        "trl_rounds_samples_per_s": [round(rate(t), 2) for t in trls],
        "trl_generation_s_per_step": None if trl is None else trl.get("generation_s"),
        "trl_wall_s": None if trl is None else round(trl["wall_s"], 2),
        "trl_peak_rss_mib": None if trl is None else trl.get("peak_rss_mib"),
        "trl_activation_checkpointing": None
        if trl is None
        else trl.get("activation_checkpointing"),
        "unshared_samples_per_s": None if pu is None else round(rate(pu), 2),
        "unshared_rounds_samples_per_s": [round(rate(p), 2) for p in unshared],
        "unshared_generation_s_per_step": None if pu is None else pu["phases_s"].get("generation"),
    }
    if skipped:
        result["skipped"] = skipped
    return result


def _cpu_per_wall(side: dict) -> float | None:
    """The side's CPU seconds (every thread of its process) per wall-clock second over its
    timed steps: about 1 for a side that kept to one core."""
    return round(side["cpu_s"] / side["wall_s"], 3) if "cpu_s" in side and side["wall_s"] else None


def _balanced(firsts: list[str]) -> bool:
    """Whether trust on and trust off each went first in half the rounds (the best-round
    rule favours the side that more often runs second)."""
    return firsts.count("trust_on") == firsts.count("trust_off")


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def rows_gib(args: argparse.Namespace) -> float:
    """A kept-rows budget that holds every contributor's gradient rows of the model: whole
    GiB over contributors x parameters x 4 bytes, plus 1 (the trainer's default, 1 GiB,
    for the demo model, whose directory the trainer side builds itself)."""
    if not args.model_dir:
        return 1.0
    rows = args.contributors * model_params(Path(args.model_dir)) * 4
    return float(math.ceil(rows / 2**30) + 1)


SIDE_BYTES_PER_PARAM = 240
"""Both sides' resident memory together per model parameter, besides the trust-on side's
per-contributor gradient rows (4 bytes a parameter each): an upper bound on what was
measured (peak resident: trust on 2514 and trust off 1217 MiB at 14M; 19238 and 7754 MiB
at SmolLM2-135M, with 8 contributors' rows kept)."""
PROCESS_BYTES = 1 << 30
"""Each side's Python process, torch and transformers before any model (at most)."""


def interleave_refusal(args: argparse.Namespace) -> str | None:
    """Why trust on and trust off cannot run at once on this machine, or None when they
    fit: both sides' estimated memory (``SIDE_BYTES_PER_PARAM`` and the rows per
    parameter) against the memory available now."""
    if not args.model_dir:
        return None  # the demo model: a few MB a side
    params = model_params(Path(args.model_dir))
    need = params * (SIDE_BYTES_PER_PARAM + 4 * args.contributors) + 2 * PROCESS_BYTES
    have = available_bytes()
    if need <= have:
        return None
    return (
        f"both sides at once need about {need / 2**30:.1f} GiB for {params / 1e6:.1f}M "
        f"parameters and {args.contributors} contributors; {have / 2**30:.1f} GiB is available"
    )


def available_bytes() -> int:
    """Memory available to new processes (Linux ``MemAvailable``; elsewhere all of it)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def compare(args: argparse.Namespace, skipped: str | None) -> dict:
    """``args.rounds`` rounds, each running trust-on and trust-off (in turns where both fit
    in memory, else one after the other; which goes first swaps every round), then, with TRL,
    prooftrain with its prefill unshared and TRL; their summary."""
    ons: list[dict] = []
    offs: list[dict] = []
    trls: list[dict] = []
    unshared: list[dict] = []
    order: list[str] = []
    if args.keep_gib is None:
        args = argparse.Namespace(**{**vars(args), "keep_gib": rows_gib(args)})
    why = interleave_refusal(args) if args.interleave else "--no-interleave"
    if why:
        say(f"the sides run one after the other: {why}")
        args = argparse.Namespace(**{**vars(args), "interleave": False, "interleave_skipped": why})
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}")
        first = "trust_on" if r % 2 == 0 else "trust_off"
        order.append(first)
        if args.interleave:
            on, off = run_interleaved(args, first)
            ons.append(on)
            offs.append(off)
        elif first == "trust_on":
            ons.append(run_side("prooftrain", args))
            offs.append(run_side("trust_off", args))
        else:
            offs.append(run_side("trust_off", args))
            ons.append(run_side("prooftrain", args))
        if not skipped:
            unshared.append(run_side("prooftrain", args, unshared=True))
            trls.append(run_side("trl", args))
    args = argparse.Namespace(**{**vars(args), "order": order})
    return summarise(args, ons, offs, trls, unshared, skipped)


# -- scaling: three model sizes in one run ------------------------------------------------

SIZES = {
    "demo": "the demo base model",
    "14m": "random-init Llama, hidden 384, 6 layers",
    "smollm2-135m": "SmolLM2-135M-Instruct",
}
SIZE_STEPS = (80, 12, 10)
SIZE_ROUNDS = (4, 4, 4)
MEMORY_CONTRIBUTORS = (4, 8)


def model_params(model_dir: Path) -> int:
    """Parameters stored in a model directory's safetensors files (a tied tensor once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                total += math.prod(f.get_slice(name).get_shape())
    return total


def smollm2_dir(given: str | None) -> tuple[Path | None, str | None]:
    """The SmolLM2-135M directory to use, or None and why it is skipped."""
    if given:
        path = Path(given)
        return (
            (path, None)
            if (path / "config.json").is_file()
            else (
                None,
                f"--smollm2-dir {given} holds no model (prooftrain models fetch smollm2-135m)",
            )
        )
    try:
        from rollout.pretrained import default_model_dir
    except ImportError:
        return None, "no SmolLM2 fetch in this checkout (rollout.pretrained) and no --smollm2-dir"
    path = default_model_dir("smollm2-135m")
    if not (path / "config.json").is_file():
        return None, (
            f"SmolLM2-135M not fetched to {path}: run `prooftrain models fetch "
            "smollm2-135m` or pass --smollm2-dir"
        )
    return path, None


def size_model(size: str, args: argparse.Namespace, tmp: Path) -> tuple[Path | None, str | None]:
    if size == "demo":
        from trainer.base_model import ensure_base_model

        return ensure_base_model(args.task, SEED, progress=False), None
    if size == "14m":
        return build_wide_model(384, 6, tmp / "14m", args.task), None
    return smollm2_dir(args.smollm2_dir)


def run_scaling(args: argparse.Namespace, skipped: str | None) -> dict:
    """The comparison at each size of ``args.sizes``, then the aggregator's memory."""
    steps, rounds = args.scaling_steps, args.scaling_rounds
    sizes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="trust-overhead-models-") as tmp:
        for i, size in enumerate(args.sizes):
            model_dir, why = size_model(size, args, Path(tmp))
            if model_dir is None:
                say(f"{size}: skipped: {why}")
                sizes[size] = {"model": SIZES[size], "skipped": why}
                continue
            say(f"{size}: {SIZES[size]} from {model_dir}")
            sub = argparse.Namespace(
                **{
                    **vars(args),
                    "model_dir": str(model_dir),
                    "steps": steps[i],
                    "rounds": rounds[i],
                    "size": size,
                }
            )
            result = compare(sub, skipped)
            result.update(model=SIZES[size], params=model_params(model_dir))
            sizes[size] = result
    ratios = {k: v.get("trl_ratio") for k, v in sizes.items()}
    measured = [r for r in ratios.values() if r is not None]
    return {
        "bench": "trust_overhead",
        "mode": "scaling",
        "trust_ratios": {k: v.get("trust_ratio") for k, v in sizes.items()},
        "trust_ratio_targets": {k: TRUST_TARGETS[k] for k in sizes},
        "trust_ratio_baseline": TRUST_BASELINE,
        "load": {"end": load()},
        "trl_ratio_target": RATIO_TARGET,
        "trl_ratio_baseline": TRL_BASELINE,
        "trl_ratios": ratios,
        "trl_ratio_holds_with_size": (
            all(b >= a for a, b in zip(measured, measured[1:], strict=False))
            if len(measured) > 1
            else None
        ),
        "sizes": sizes,
        "aggregation_memory": aggregation_memory(args.memory_params),
        **({"skipped": skipped} if skipped else {}),
    }


def aggregation_memory(params: int) -> dict:
    """The default aggregator's extra peak memory on ``params`` parameters at two
    contributor counts, each in a fresh process."""
    runs = [aggregation_peak(n, params) for n in MEMORY_CONTRIBUTORS]
    return {
        "params": params,
        "runs": runs,
        "rows": "n x d float32 (the per-contributor gradients the trainer holds)",
        "extra": "per run: extra_peak_bytes over the rows, and as a multiple of d float32",
    }


def steady_warmup(contributors: int, groups: int, group_size: int) -> int:
    """Steps that take every contributor off probation, plus one: each step trains
    ``groups`` groups of ``group_size`` completions spread over ``contributors``, and a key
    leaves probation after ``PROBATION_ROLLOUTS`` audited completions (every completion is
    audited until then)."""
    from ledger.reputation import PROBATION_ROLLOUTS

    return 1 + math.ceil(PROBATION_ROLLOUTS * contributors / (groups * group_size))


def side_warmup(side: str, args: argparse.Namespace) -> int:
    """Untimed steps of ``side``: prooftrain's own, or the baseline sides' (no contributors,
    no probation)."""
    return args.warmup_steps if side == "prooftrain" else args.baseline_warmup_steps


def warmup_steps(text: str) -> int | str:
    return text if text == "steady" else int(text)


def counts(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per side")
    parser.add_argument(
        "--warmup-steps",
        type=warmup_steps,
        default="steady",
        help="untimed steps before them on prooftrain's side (default 'steady': enough to "
        "take every contributor off probation, plus one, so the timed steps see the "
        "validator's steady audit rate; N: from step N + 1, probation included)",
    )
    parser.add_argument(
        "--baseline-warmup-steps",
        type=int,
        default=1,
        help="untimed steps before them on the trust-off and TRL sides (default 1)",
    )
    parser.add_argument("--groups", type=int, default=8, help="prompts per optimizer step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=8, help="completion length limit")
    parser.add_argument("--contributors", type=int, default=8, help="honest contributors")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of both sides")
    parser.add_argument(
        "--task",
        default=TASK,
        help=f"task of both sides (default {TASK}: partial credit, so every gradient is real)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds, each running every side once (trust on and off alternate which goes "
        "first: an even count lets each go first equally often); trust_ratio is the median "
        "of the rounds' ratios where the sides take turns, else each side's best round "
        "(default 4)",
    )
    parser.add_argument(
        "--model-dir",
        type=model_dir_arg,
        help="a local Hugging Face model directory for both sides (default: the demo base model)",
    )
    parser.add_argument(
        "--width",
        type=int,
        help="instead: a randomly initialised Llama of this "
        "hidden size (and --layers) with the demo tokenizer, built for the run "
        "(throughput only; e.g. --width 384 --layers 6 is 14M parameters)",
    )
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of --width's model")
    parser.add_argument(
        "--pass-per-contributor",
        action="store_true",
        help="prooftrain's RL step runs a pass per contributor (its fallback)",
    )
    parser.add_argument(
        "--gram-sketch",
        type=int,
        default=0,
        help="prooftrain's aggregator works from a random W x W sketch of each weight "
        "matrix's per-contributor gradient (trainer aggregator.gram_sketch; default 0: "
        "the exact Gram matrix)",
    )
    parser.add_argument(
        "--keep-gib",
        type=float,
        default=None,
        help="memory (GiB) for per-contributor gradient rows kept between prooftrain's Gram "
        "matrix and its combine (trainer aggregator.keep_gib); rows beyond it are formed "
        "twice (default: every contributor's rows of the model, rounded up, plus 1 GiB)",
    )
    parser.add_argument("--unshared-prefill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="compare at every size of --sizes in one run, then measure the "
        "aggregator's memory at two contributor counts",
    )
    parser.add_argument(
        "--sizes",
        type=lambda t: tuple(t.split(",")),
        default=tuple(SIZES),
        help=f"sizes for --scaling, of {','.join(SIZES)}",
    )
    parser.add_argument(
        "--scaling-steps",
        type=counts,
        default=SIZE_STEPS,
        help="timed steps per size for --scaling (comma-separated)",
    )
    parser.add_argument(
        "--scaling-rounds",
        type=counts,
        default=SIZE_ROUNDS,
        help="rounds per size for --scaling (comma-separated)",
    )
    parser.add_argument(
        "--smollm2-dir",
        help="SmolLM2-135M directory for --scaling (default: "
        "where `prooftrain models fetch smollm2-135m` puts it)",
    )
    parser.add_argument(
        "--memory-params",
        type=int,
        default=14_000_000,
        help="parameters of the aggregator memory measurement of --scaling",
    )
    parser.add_argument("--quiet", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--turns", help=argparse.SUPPRESS)
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run trust on and trust off at once, taking turns step by step, so load that "
        "comes and goes falls on both alike (default; a size whose two sides do not fit in "
        "the memory available runs them one after the other, and the JSON's "
        "interleave_skipped says so); --no-interleave: always one after the other",
    )
    args = parser.parse_args()
    if (
        min(args.steps, args.groups, args.max_tokens, args.contributors, args.rounds) < 1
        or args.group_size < 2
    ):
        parser.error("need --group-size >= 2 and every other count >= 1")
    if args.warmup_steps == "steady":
        args.warmup_steps = steady_warmup(args.contributors, args.groups, args.group_size)
    if min(args.warmup_steps, args.baseline_warmup_steps) < 1:
        parser.error(
            "need --warmup-steps and --baseline-warmup-steps >= 1 "
            "(the first step loads and warms every side)"
        )
    args.size = "14m" if args.width == 384 and args.layers == 6 else None
    if args.width and args.model_dir:
        parser.error("give --model-dir or --width, not both")
    if args.scaling:
        unknown = sorted(set(args.sizes) - set(SIZES))
        if unknown or not args.sizes:
            parser.error(f"unknown sizes {unknown}; known: {','.join(SIZES)}")
        n = len(SIZES)
        if (
            len(args.scaling_steps) != n
            or len(args.scaling_rounds) != n
            or min(args.scaling_steps + args.scaling_rounds) < 1
        ):
            parser.error(
                f"--scaling-steps and --scaling-rounds need {n} counts >= 1 "
                f"(one per size of {','.join(SIZES)})"
            )
        index = [list(SIZES).index(s) for s in args.sizes]
        args.scaling_steps = tuple(args.scaling_steps[i] for i in index)
        args.scaling_rounds = tuple(args.scaling_rounds[i] for i in index)
    return args


def main() -> None:
    args = parse_args()
    if args.side:
        with tempfile.TemporaryDirectory(prefix=f"trust-overhead-{args.side}-") as tmp:
            print(json.dumps(SIDES[args.side](args, Path(tmp))))
        return
    skipped = None if importlib.util.find_spec("trl") is not None else TRL_MISSING
    if skipped:
        say(f"TRL side skipped: {skipped}")
    if args.scaling:
        emit(run_scaling(args, skipped))
        return
    with tempfile.TemporaryDirectory(prefix="trust-overhead-model-") as tmp:
        if args.width:
            args.model_dir = str(build_wide_model(args.width, args.layers, Path(tmp)))
        result = compare(args, skipped)
    if args.width:
        result["model"] = f"random-init Llama, hidden {args.width}, {args.layers} layers"
    emit(result)


if __name__ == "__main__":
    main()
