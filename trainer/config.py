"""The trainer's configuration: one pydantic model, loaded from TOML, checked on load.

Unknown keys are errors; every number is bounded; every field says what it
does. ``load_trainer_config(path, overrides)`` names the file and the
offending keys in its ``ConfigError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.groupgrad import GRAM_KEEP_BYTES
from trainer.losses import POLICY_LOSSES, get_policy_loss
from trainer.network_rules import NetworkRules
from trainer.rl import LR_SCHEDULES
from trainer.toml_config import load_toml_model
from verify.aggregate import AGGREGATORS, Aggregator, GramAggregator, get_aggregator
from verify.weights_codec import get_codec


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LossSection(_Section):
    name: str = "tis"
    """Policy loss from ``trainer.losses`` (tis, ppo-decoupled, icepop)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the loss (e.g. ``cap`` for tis)."""
    importance_sampling: bool = True
    """Weight tokens by current/behaviour ratios. False treats every sample as on-policy
    (ratio 1): a baseline for benchmarks only."""
    normalize_std: bool = True
    """GRPO advantages divide by the group's reward std; False gives r - mean (Dr. GRPO)."""


class AggregatorSection(_Section):
    name: str = "centered-clip"
    """Robust aggregator of per-contributor gradients (``verify.aggregate``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the aggregator (e.g. ``tau`` for centered-clip)."""
    reputation_weights: bool = False
    """Weight each contributor's gradient by its reputation score."""
    gram_sketch: int = Field(default=0, ge=0, le=4096)
    """0: the aggregator sees the contributors' exact Gram matrix. w > 0: an unbiased
    estimate from a fresh random w x w sketch of each weight matrix's per-contributor
    gradient, drawn after the batch is fixed (``trainer.groupgrad``): the rows are never
    formed, so per-contributor gradients cost about one mean gradient; distances between
    contributors are off by a few percent (docs/trainer.md). Only with a Gram aggregator
    (``mean``, ``centered-clip``)."""
    keep_gib: float = Field(default=GRAM_KEEP_BYTES / 2**30, ge=0.0, le=65536.0)
    """Memory (GiB) for per-contributor gradient rows kept between the exact Gram matrix and
    the combine (``trainer.groupgrad``). Rows beyond it are formed twice, for the Gram
    matrix and again in the weighted combine. All rows take 4 x contributors x parameters
    bytes (8 contributors: 0.45 GiB at 14M parameters, 4.0 GiB at SmolLM2-135M): a budget
    that holds them saves the second product (at 135M, a step about 0.73x as long)."""


class LocalSection(_Section):
    """The in-process network used when no validator URL is given (``node.local``)."""

    contributors: int = Field(default=4, ge=1, le=256)
    """Honest contributors."""
    group_size: int = Field(default=8, ge=2, le=64)
    """Completions per prompt (GRPO group)."""
    max_tokens: int = Field(default=8, ge=1, le=4096)
    """Completion length limit."""
    temperature: float = Field(default=1.0, gt=0.0, le=4.0)
    """Sampling temperature of the rollouts (the trainer scores at the same one)."""
    pool: int = Field(default=8192, ge=16)
    """Train-split problems the validator assigns from."""
    groups_per_fetch: int = Field(default=16, ge=1, le=4096)
    """Groups the contributors produce whenever the trainer finds the stream empty."""


class PublishSection(_Section):
    codec: str = "int8-block"
    """Codec of each published update (``verify.weights_codec.CODECS``)."""
    codec_params: dict[str, Any] = Field(default_factory=dict)
    snapshot_every: int = Field(default=50, ge=0)
    """Every N-th version is a full fp32 snapshot (bounds the delta chain); 0 never."""


class TrainerConfig(_Section):
    model_dir: Path | None = None
    """Base policy directory; None builds or reuses the cached demo base model."""
    task: str = "arithmetic"
    """Task of the demo base model and of evals."""
    stages: int = Field(default=1, ge=1, le=64)
    """Pipeline stages S (one process each; torchrun when S > 1)."""
    steps: int = Field(default=400, ge=0, le=10_000_000)
    """Optimizer steps (policy versions) to train."""
    lr: float = Field(default=1e-4, gt=0.0, le=1.0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    adam_eps: float = Field(default=1e-8, gt=0.0, le=1.0)
    """AdamW epsilon."""
    lr_schedule: str = "constant"
    """Decay after warm-up (``trainer.rl.LR_SCHEDULES``): constant, linear or cosine over
    ``steps``."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up steps."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Floor of the decay as a fraction of ``lr`` (constant ignores it)."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    """Clip the aggregated gradient to this global l2 norm; 0 disables."""
    loss: LossSection = LossSection()
    aggregator: AggregatorSection = AggregatorSection()
    rules: NetworkRules = NetworkRules()
    """``[trainer.rules]``: the network's shared settings (the staleness bound the buffer
    drops by). Against a validator they are the validator's (``trainer.remote_network``)."""
    batch_groups: int = Field(default=16, ge=1, le=4096)
    """GRPO groups per optimizer step."""
    skip_uniform_groups: bool = True
    """Consume groups whose rewards are all equal without training on them."""
    mode: Literal["async", "sync"] = "async"
    """async: train on anything within the staleness bound; sync: only on the current version."""
    buffer_capacity: int = Field(default=4096, ge=1, le=1_000_000)
    """Samples the buffer may hold."""
    microbatches: int = Field(default=1, ge=1, le=1024)
    """Pipeline micro-batches per contributor gradient."""
    eval_every: int = Field(default=100, ge=0)
    """Evaluate every this many steps (and at the start and end); 0 disables."""
    eval_problems: int = Field(default=300, ge=1, le=100_000)
    """Held-out problems per eval (greedy pass@1)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go; None disables them (``prooftrain trainer --validator`` then uses
    ``runs/trainer/checkpoints``)."""
    checkpoint_every: int = Field(default=100, ge=1)
    seed: int = Field(default=0, ge=0)
    threads: int = Field(default=1, ge=1, le=256)
    """torch intra-op threads per process; 1 avoids oversubscribing cores shared with the
    contributors and other stages."""
    starve_timeout_s: float = Field(default=600.0, gt=0)
    """Fail when no usable samples arrive for this long."""
    local: LocalSection = LocalSection()
    publish: PublishSection = PublishSection()

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainerConfig:
        if self.loss.name not in POLICY_LOSSES:
            raise ValueError(f"unknown loss {self.loss.name!r}; known: {sorted(POLICY_LOSSES)}")
        if self.aggregator.name not in AGGREGATORS:
            raise ValueError(
                f"unknown aggregator {self.aggregator.name!r}; known: {sorted(AGGREGATORS)}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"unknown lr_schedule {self.lr_schedule!r}; known: {sorted(LR_SCHEDULES)}"
            )
        get_policy_loss(self.loss.name, **self.loss.params)
        check_gram_sketch(
            self.aggregator.gram_sketch,
            get_aggregator(self.aggregator.name, **self.aggregator.params),
            self.aggregator.name,
        )
        get_codec(self.publish.codec, **self.publish.codec_params)
        if self.batch_groups * self.local.group_size > self.buffer_capacity:
            raise ValueError("buffer_capacity must hold at least batch_groups * group_size samples")
        return self


def check_gram_sketch(width: int, aggregator: Aggregator, name: str) -> None:
    """A Gram sketch (``aggregator.gram_sketch`` > 0) needs an aggregator that works from the
    contributors' Gram matrix; any other would ignore it."""
    if width and not isinstance(aggregator, GramAggregator):
        raise ValueError(
            f"aggregator.gram_sketch = {width} needs an aggregator that works from the "
            f"contributors' Gram matrix (mean, centered-clip); {name!r} needs the gradients "
            "themselves: set gram_sketch = 0 or change the aggregator"
        )


def load_trainer_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> TrainerConfig:
    """Read ``path`` (TOML, optional ``[trainer]`` table) and apply dotted ``overrides``."""
    return load_toml_model(TrainerConfig, path, overrides, table="trainer")
