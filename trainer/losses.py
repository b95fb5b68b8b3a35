"""Off-policy policy-gradient losses over committed behaviour logprobs.

Shapes::

    logprobs            (B, T)  current policy, carries the gradient
    behaviour_logprobs  (B, T)  what the contributor committed (spot-checked)
    proximal_logprobs   (B, T)  optional: policy at the start of this step
    ref_logprobs        (B, T)  optional: reference policy for a KL penalty
    advantages          (B,)    one per completion (see group_advantages)
    mask                (B, T)  1 for completion tokens that count

The behaviour logprobs come from a generator nobody fully trusts, so every loss
bounds what a wrong behaviour logprob can do to the update: TIS caps the ratio at
C, decoupled PPO caps the behaviour weight and clips the proximal ratio, IcePop
drops tokens whose ratio leaves [a, b]. Ratios and masks are computed without
gradient; the gradient flows only through ``logprobs``.

Every loss averages over counted tokens (token-mean) and returns the scalar loss
and a dict of float metrics named ``train/...`` and ``off_policy/...``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from verify.errors import build_registered

Metrics = dict[str, float]


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: ``(r - mean_group) / (std_group + eps)``, shape (B,).

    ``rewards`` is (B,) with ``group_ids`` (B,) integer labels, or (n_groups, G)
    without them (then flattened row-major). ``std`` is the population standard
    deviation of the group; ``normalize_std=False`` gives ``r - mean_group``
    (Dr. GRPO). Invariant: advantages sum to zero within every group; a group
    whose rewards are all equal gets zeros.
    """
    r = rewards.detach().to(torch.float32)
    if group_ids is None:
        if r.dim() != 2:
            raise ValueError(
                f"rewards without group_ids must be (n_groups, G), got {tuple(r.shape)}"
            )
        mean = r.mean(dim=1, keepdim=True)
        centered = r - mean
        if normalize_std:
            centered = centered / (r.std(dim=1, correction=0, keepdim=True) + eps)
        return centered.flatten()
    if r.dim() != 1 or group_ids.shape != r.shape:
        raise ValueError(
            f"rewards and group_ids must both be (B,), got {tuple(r.shape)}, {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    count = r.new_zeros(n).index_add_(0, inverse, torch.ones_like(r))
    mean = r.new_zeros(n).index_add_(0, inverse, r) / count
    centered = r - mean[inverse]
    if not normalize_std:
        return centered
    var = r.new_zeros(n).index_add_(0, inverse, centered**2) / count
    return centered / (var.sqrt()[inverse] + eps)


@runtime_checkable
class PolicyLoss(Protocol):
    """Per-token policy-gradient loss with off-policy correction."""

    @property
    def name(self) -> str: ...

    def __call__(
        self,
        logprobs: Tensor,
        behaviour_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        proximal_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]: ...


POLICY_LOSSES: dict[str, Callable[..., PolicyLoss]] = {}


def register_policy_loss(
    name: str,
) -> Callable[[Callable[..., PolicyLoss]], Callable[..., PolicyLoss]]:
    def deco(factory: Callable[..., PolicyLoss]) -> Callable[..., PolicyLoss]:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} registered twice")
        POLICY_LOSSES[name] = factory
        return factory

    return deco


def get_policy_loss(name: str, **params: object) -> PolicyLoss:
    """Build the loss registered as ``name``; ConfigError on a bad name or parameter."""
    return build_registered("policy loss", POLICY_LOSSES, name, params)


# -- shared pieces ----------------------------------------------------------------------


def _check(
    logprobs: Tensor, behaviour: Tensor, advantages: Tensor, mask: Tensor, *others: Tensor | None
) -> Tensor:
    """Validate shapes; return the mask as float (B, T)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(logprobs.shape)}")
    for name, t in [("behaviour_logprobs", behaviour), ("mask", mask)] + [
        ("logprobs", o) for o in others if o is not None
    ]:
        if t.shape != logprobs.shape:
            raise ValueError(
                f"{name} must have shape {tuple(logprobs.shape)}, got {tuple(t.shape)}"
            )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be (B,) = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}"
        )
    return mask.to(logprobs.dtype)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(q || p) from samples of q, with log_ratio = log p - log q."""
    return torch.expm1(log_ratio) - log_ratio


def _finish(
    per_token: Tensor,
    logprobs: Tensor,
    behaviour: Tensor,
    mask: Tensor,
    ref: Tensor | None,
    kl_coef: float,
    metrics: Metrics,
) -> tuple[Tensor, Metrics]:
    """Token-mean loss, optional KL-to-reference penalty, and the common metrics."""
    loss = _masked_mean(per_token, mask)
    with torch.no_grad():
        log_ratio = (logprobs - behaviour).detach()
        ratio = torch.exp(log_ratio)
        valid = mask > 0
        any_valid = bool(valid.any())
        metrics = {
            "off_policy/ratio_mean": float(_masked_mean(ratio, mask)),
            "off_policy/ratio_max": float(ratio[valid].max()) if any_valid else 1.0,
            "off_policy/ratio_min": float(ratio[valid].min()) if any_valid else 1.0,
            # samples come from the behaviour policy: k3 with log(current / behaviour)
            "off_policy/kl_behaviour": float(_masked_mean(_k3(log_ratio), mask)),
            "off_policy/masked_fraction": 0.0,
            "off_policy/clipped_fraction": 0.0,
            **metrics,
            "train/tokens": float(mask.sum()),
        }
    if ref is not None and kl_coef > 0:
        kl = _masked_mean(_k3(ref.detach() - logprobs), mask)
        loss = loss + kl_coef * kl
        metrics["train/kl_ref"] = float(kl.detach())
    metrics["train/loss"] = float(loss.detach())
    return loss, metrics


def _is_ratio(logprobs: Tensor, behaviour: Tensor) -> Tensor:
    """Detached importance ratio ``pi / mu`` per token, (B, T)."""
    return torch.exp(logprobs.detach() - behaviour.detach())


class _TokenLoss:
    """``PolicyLoss.__call__`` shared by the registered losses.

    Checks shapes, asks ``_per_token`` for the (B, T) per-token loss and the
    loss-specific metrics, then hands both to ``_finish``. ``proximal_logprobs``
    is shape-checked only by losses with ``uses_proximal``; the others ignore it.
    """

    kl_coef: float
    uses_proximal: ClassVar[bool] = False

    def _per_token(
        self, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, prox: Tensor | None
    ) -> tuple[Tensor, Metrics]:
        """Per-token loss (B, T) and metrics; ``adv`` is the detached (B, 1) advantage."""
        raise NotImplementedError

    def __call__(
        self,
        logprobs: Tensor,
        behaviour_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        proximal_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]:
        checked_prox = proximal_logprobs if self.uses_proximal else None
        m = _check(logprobs, behaviour_logprobs, advantages, mask, checked_prox, ref_logprobs)
        adv = advantages.detach()[:, None]
        per_token, metrics = self._per_token(
            logprobs, behaviour_logprobs, adv, m, proximal_logprobs
        )
        return _finish(
            per_token, logprobs, behaviour_logprobs, m, ref_logprobs, self.kl_coef, metrics
        )


# -- losses -----------------------------------------------------------------------------


@register_policy_loss("tis")
@dataclass(frozen=True)
class TruncatedIS(_TokenLoss):
    """Truncated importance sampling: ``-min(pi/mu, C) * A * log pi`` per token.

    The weight is detached, so the gradient is ``min(rho, C) * A * grad log pi``;
    with rho = 1 (on-policy) this is REINFORCE. A wrong behaviour logprob scales a
    token's gradient by at most C.
    """

    cap: float = 2.0
    kl_coef: float = 0.0
    name: ClassVar[str] = "tis"

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0, got {self.cap}")

    def _per_token(
        self, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, prox: Tensor | None
    ) -> tuple[Tensor, Metrics]:
        ratio = _is_ratio(logprobs, behaviour)
        weight = ratio.clamp(max=self.cap)
        per_token = -weight * adv * logprobs
        clipped = float(_masked_mean((ratio > self.cap).to(mask.dtype), mask))
        return per_token, {"off_policy/clipped_fraction": clipped}


@register_policy_loss("ppo-decoupled")
@dataclass(frozen=True)
class DecoupledPPO(_TokenLoss):
    """Decoupled PPO (Hilton et al., 2022): behaviour mu, proximal pi_prox, current pi.

    Per token ``-w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with
    ``r = pi / pi_prox`` and the detached behaviour weight ``w = pi_prox / mu``,
    capped at ``behaviour_cap`` when given. Without proximal logprobs pi_prox = mu,
    w = 1, and this is vanilla PPO-clip against the behaviour policy.
    """

    clip_eps: float = 0.2
    behaviour_cap: float | None = 5.0
    kl_coef: float = 0.0
    name: ClassVar[str] = "ppo-decoupled"
    uses_proximal: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.behaviour_cap is not None and not self.behaviour_cap > 0:
            raise ValueError(f"behaviour_cap must be > 0, got {self.behaviour_cap}")

    def _per_token(
        self, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, prox: Tensor | None
    ) -> tuple[Tensor, Metrics]:
        prox = (behaviour if prox is None else prox).detach()
        weight = torch.exp(prox - behaviour.detach())
        if self.behaviour_cap is not None:
            weight = weight.clamp(max=self.behaviour_cap)
        r = torch.exp(logprobs - prox)
        surrogate = torch.minimum(r * adv, r.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv)
        per_token = -weight * surrogate
        with torch.no_grad():
            clipped = ((r - 1).abs() > self.clip_eps) & (r * adv > surrogate)
            metrics = {
                "off_policy/clipped_fraction": float(_masked_mean(clipped.to(mask.dtype), mask)),
                "off_policy/behaviour_weight_mean": float(_masked_mean(weight, mask)),
            }
        return per_token, metrics


@register_policy_loss("icepop")
@dataclass(frozen=True)
class IcePop(_TokenLoss):
    """IcePop: drop tokens whose ratio ``pi/mu`` leaves ``[low, high]``.

    Kept tokens get the importance-weighted gradient ``rho * A * grad log pi``
    (detached rho); dropped tokens contribute nothing but still count in the
    token-mean denominator, so a large mismatch shrinks the update instead of
    redirecting it. ``off_policy/masked_fraction`` is the dropped share.
    """

    low: float = 0.5
    high: float = 2.0
    kl_coef: float = 0.0
    name: ClassVar[str] = "icepop"

    def __post_init__(self) -> None:
        if not 0 <= self.low <= 1 <= self.high:
            raise ValueError(f"need 0 <= low <= 1 <= high, got [{self.low}, {self.high}]")

    def keep(self, logprobs: Tensor, behaviour_logprobs: Tensor) -> Tensor:
        """Boolean (B, T): tokens whose ratio lies in [low, high]."""
        ratio = _is_ratio(logprobs, behaviour_logprobs)
        return (ratio >= self.low) & (ratio <= self.high)

    def _per_token(
        self, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, prox: Tensor | None
    ) -> tuple[Tensor, Metrics]:
        ratio = _is_ratio(logprobs, behaviour)
        keep = self.keep(logprobs, behaviour).to(mask.dtype)
        per_token = -keep * ratio * adv * logprobs
        masked = float(_masked_mean(1 - keep, mask))
        return per_token, {"off_policy/masked_fraction": masked}
