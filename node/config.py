"""Typed configuration for every runnable role, loaded from TOML and checked on load.

Every model forbids unknown keys (a typo is an error, not a silently ignored
setting), bounds every number, and documents every field. ``load(cls, path)``
reads a TOML file; ``ConfigError`` names the file and the offending keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.network_rules import NetworkRules
from trainer.toml_config import load_toml_model


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSection(_Section):
    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default; expose deliberately."""
    port: int = Field(default=8470, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    key_file: Path = Path("keys/validator.key")
    """The validator's Ed25519 key (signs assignments, verdicts and checkpoints)."""
    ledger: str = "runs/validator/ledger.sqlite"
    """SQLite file path, or a postgresql:// URL for a shared log."""
    state_file: Path | None = None
    """The node's own SQLite database beside the ledger (sample bodies, in ``<state_file>.bodies``,
    submission answers, assignments, manifests, unrevealed epoch secrets; mode 0600). Default:
    ``<ledger>.state`` for a SQLite ledger, ``runs/validator/node.state`` for a postgresql:// one.
    On a postgresql:// log it holds only this node's assignments and epoch secrets (the rest is
    in PostgreSQL, read by every node: ``node.validator.shared_state``); each validator sharing
    the log needs its own."""
    blob_dir: Path | None = None
    """The content-addressed blob store (policy updates and manifests, eval statements, large
    slash evidence; what `prooftrain release` and `audit verify --blobs` read). Default:
    ``<ledger>.blobs`` for a SQLite ledger, ``runs/validator/blobs`` for a postgresql:// one.
    Validators sharing one PostgreSQL log share this directory (a volume every node reaches)."""
    origin: str = "prooftrain/validator"
    """Checkpoint origin line: the log's name."""
    trainer_key: str = ""
    """Trainer public key (64 hex digits or a .pub file); only it may read accepted samples
    and publish policies. Empty disables those endpoints."""
    checkpoint_every: int = Field(default=64, ge=1)
    """Sign a checkpoint after this many submissions."""
    admission_threads: int = Field(default=1, ge=1, le=256)
    """Threads admitting submissions. Each takes every submission waiting (at most
    ``audit.queue``) as one batch: one spot-check forward pass and one ledger commit for it.
    One is fastest unless spot checks dominate: admission is mostly Python, and more
    threads contend with the HTTP event loop for the interpreter lock."""
    admission_processes: int = Field(default=0, ge=0, le=256)
    """Worker processes that verify submitted envelopes and compute rewards before admission
    (``node.validator.precheck``), taking that work off the node's own process; 0 does it on
    the admission threads. One per core left after the node and its spot checks."""
    cpu_affinity: bool = True
    """With precheck workers and a CPU to spare for each, run each worker on a CPU of its own
    and the node's own threads on the others, so they never preempt a worker (Linux;
    ``node.validator.affinity``). Spot checks' forward passes still use every CPU."""

    def is_postgres(self) -> bool:
        return self.ledger.startswith(("postgresql://", "postgres://"))

    def ledger_path(self) -> Path | None:
        """The SQLite ledger's file (``node.ledger`` less any ``sqlite:``); None for a
        PostgreSQL one."""
        return None if self.is_postgres() else Path(self.ledger.removeprefix("sqlite:"))

    def state_path(self) -> Path:
        """Where the node's state database is (``state_file`` or its default)."""
        if self.state_file is not None:
            return self.state_file
        return POSTGRES_STATE if self.is_postgres() else Path(self.ledger + ".state")

    def blob_path(self) -> Path:
        """Where the blob store is (``blob_dir`` or its default)."""
        if self.blob_dir is not None:
            return self.blob_dir
        ledger = self.ledger_path()
        return POSTGRES_BLOBS if ledger is None else Path(f"{ledger}.blobs")


POSTGRES_STATE = Path("runs/validator/node.state")
POSTGRES_BLOBS = Path("runs/validator/blobs")


class PolicySection(_Section):
    model_dir: Path = Path("runs/base-model")
    """The base policy: a local Hugging Face model directory (policy version 0)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the validator's recomputation."""


class TaskSection(_Section):
    name: str = "arithmetic"
    """Task generator (rewards.tasks) whose train split the validator assigns."""
    seed: int = Field(default=0, ge=0)
    pool: int = Field(default=4_096, ge=1, le=10_000_000)
    """How many train problems to draw from the generator."""
    jsonl: Path | None = None
    """Optional JSONL problem file (prompt, answer, task) instead of the generator."""


class AssignmentSection(_Section):
    group_size: int = Field(default=4, ge=1, le=64)
    """G completions per prompt (GRPO group)."""
    temperature: float = Field(default=1.0, gt=0.0, le=4.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    max_tokens: int = Field(default=16, ge=1, le=65_536)
    sampler: Literal["icdf-v1", "gumbel-v1"] = "icdf-v1"
    """The verifiable sampler contributors draw with (``verify.samplers``): inverse-CDF, one
    keyed uniform per token (default), or Gumbel-max, keyed noise per vocabulary entry
    (about 30 times the cost per token at a 49k vocabulary)."""
    ttl_s: float = Field(default=600.0, gt=0)
    """An assignment not answered within this many seconds expires."""
    chunk_size: int = Field(default=32, ge=1, le=1_024)
    """Tokens per leaf of a rollout's logprob commitment. Fixed by the validator in every
    assignment; a header with another chunk size is an ASSIGNMENT_MISMATCH."""
    max_outstanding: int = Field(default=4, ge=1, le=1_024)
    """Assignments one contributor may hold open at once (a contributor with ``--uploads N``
    holds up to N + 1). An assignment it abandons (lets expire unanswered) keeps holding its
    place for a further ``ttl_s``, and so does one answered with a discard (a group missing a
    member, an unsupported precision, late, stale or malformed: ``ledger.reputation.DISCARDS``),
    so a contributor cannot draw many prompts and submit only the groups it likes (assignment
    grinding): it can discard at most max_outstanding groups per 2 x ttl_s."""
    max_prompt_share: float = Field(default=0.25, gt=0.0, le=1.0)
    """The largest fraction of the prompt pool one key may hold in one policy version
    (assigned to it and not given back by a discard or an abandonment; at least one): no key
    can use up a version's prompts, or choose which of them it trains on."""


class AuditSection(_Section):
    chunks_per_audit: int = Field(default=0, ge=0, le=1_024)
    """Chunks of an audited rollout on which the sampler is replayed; 0 (the default) replays
    every token. Logprobs are compared on every chunk either way. A positive value trades
    coverage for cost at large vocabularies: a forged token outside the drawn chunks passes."""
    tolerance_file: Path | None = None
    """Calibrated tolerances written by `prooftrain calibrate`; None uses the built-in
    float32 tolerance."""
    min_calibration_tokens: int = Field(default=2_000, ge=1)
    """Honest tokens each setting of the tolerance file must have measured for its divergence
    nulls to be trusted; a file measured on fewer is refused at start."""
    epoch_groups: int = Field(default=256, ge=1)
    """Submissions per audit epoch (the epoch secret is revealed when it ends)."""
    pit_alpha: float = Field(default=1e-4, gt=0.0, lt=0.5)
    """Significance of the per-contributor sampling-distribution test."""
    pit_min_tokens: int = Field(default=512, ge=32)
    """Tokens a contributor's audited rollouts must pool before the PIT test is run."""
    queue: int = Field(default=8, ge=1, le=1_024)
    """Audits in flight at once; beyond it submissions get 429 with Retry-After."""


class RegistrationSection(_Section):
    work_bits: int = Field(default=0, ge=0, le=32)
    """Leading zero bits a new key's memory-hard registration proof must have
    (``verify.registration``): about 2^work_bits scrypt evaluations, paid once per key, so a
    banned cheater's fresh key or a Sybil's many keys each cost that; 0 leaves registration
    open."""
    work_log2_n: int = Field(default=14, ge=1, le=20)
    """scrypt's N = 2^work_log2_n: each evaluation needs 128 * 8 * N bytes (16 MiB at 14)."""


class LimitsSection(_Section):
    max_tokens: int = Field(default=4_096, ge=1, le=65_536)
    max_group_size: int = Field(default=64, ge=1, le=256)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1_024, le=64 * 1024 * 1024)
    requests_per_s: float = Field(default=50.0, gt=0)
    """Sustained requests per second per contributor key."""
    burst: int = Field(default=100, ge=1)


class ValidatorConfig(_Section):
    node: NodeSection = NodeSection()
    rules: NetworkRules = NetworkRules()
    """``[rules]``: the network's shared settings (staleness bound, fixed audit rate), which a
    trainer attached to this node takes from it."""
    policy: PolicySection = PolicySection()
    task: TaskSection = TaskSection()
    assignment: AssignmentSection = AssignmentSection()
    audit: AuditSection = AuditSection()
    registration: RegistrationSection = RegistrationSection()
    limits: LimitsSection = LimitsSection()

    @model_validator(mode="after")
    def _cross_checks(self) -> ValidatorConfig:
        if self.assignment.group_size > self.limits.max_group_size:
            raise ValueError("assignment.group_size exceeds limits.max_group_size")
        if self.assignment.max_tokens > self.limits.max_tokens:
            raise ValueError("assignment.max_tokens exceeds limits.max_tokens")
        return self


C = TypeVar("C", bound=BaseModel)


def load(cls: type[C], path: str | Path | None, overrides: dict | None = None) -> C:
    """Read ``path`` (TOML) into ``cls``; ``None`` gives the defaults."""
    return load_toml_model(cls, path, overrides)
