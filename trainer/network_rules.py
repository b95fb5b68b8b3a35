"""The network's shared settings: one section (``[rules]``) that the validator's, the trainer's
and a scenario's configs embed, so each setting has one definition and one default.

Who reads them: the validator admits within ``max_staleness`` and audits at ``audit_rate``;
the trainer's buffer drops what is staler than ``max_staleness``. A trainer attached to a
validator takes the validator's (``/v1/info`` ``network.rules``,
``trainer.remote_network.adopt_network``); the in-process network (``node.local``) builds
its validator from the trainer's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class NetworkRules(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_staleness: int = Field(default=4, ge=0, le=1_000)
    """Rollouts of a policy version older than current - max_staleness are rejected by the
    validator as stale, and samples that old when used are dropped by the trainer."""
    audit_rate: float = Field(default=-1.0, ge=-1.0, le=1.0)
    """A fixed spot-check rate for every contributor (experiments and benchmarks); -1 lets
    reputation set each contributor's rate."""
