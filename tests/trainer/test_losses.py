"""Off-policy losses: signs, exact clipping and masking, special cases, advantages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.losses import (
    POLICY_LOSSES,
    DecoupledPPO,
    IcePop,
    PolicyLoss,
    TruncatedIS,
    get_policy_loss,
    group_advantages,
)
from verify.errors import ConfigError

torch.set_num_threads(1)
ALL_LOSSES: list[PolicyLoss] = [TruncatedIS(cap=2.0), DecoupledPPO(), IcePop()]
METRIC_KEYS = {
    "train/loss",
    "train/tokens",
    "off_policy/ratio_mean",
    "off_policy/ratio_max",
    "off_policy/ratio_min",
    "off_policy/masked_fraction",
    "off_policy/clipped_fraction",
    "off_policy/kl_behaviour",
}


def _batch(seed: int, b: int = 4, t: int = 6, spread: float = 0.3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    current = behaviour + torch.randn(b, t, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.2).to(torch.float64)
    mask[:, 0] = 1
    return current, behaviour, adv, mask


def _grad(
    loss: PolicyLoss, current: torch.Tensor, *args: torch.Tensor, **kw: torch.Tensor
) -> torch.Tensor:
    lp = current.clone().requires_grad_(True)
    out, _ = loss(lp, *args, **kw)
    out.backward()
    assert lp.grad is not None
    return lp.grad


# -- toy problem: the gradient step moves probability the right way -------------------


@pytest.mark.parametrize("loss", ALL_LOSSES, ids=lambda x: x.name)
def test_positive_advantage_raises_logprob(loss: PolicyLoss) -> None:
    """A 3-armed softmax policy; arm 0 gets A > 0, arm 1 gets A < 0."""
    logits = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    behaviour = torch.log_softmax(torch.zeros(3), dim=0).detach()
    actions = torch.tensor([0, 1])
    adv = torch.tensor([1.0, -1.0])
    for _ in range(3):
        lp = torch.log_softmax(logits, dim=0)[actions][:, None]  # (B=2, T=1)
        out, _ = loss(lp, behaviour[actions][:, None], adv, torch.ones(2, 1))
        opt.zero_grad()
        out.backward()
        opt.step()
    probs = torch.softmax(logits.detach(), dim=0)
    assert probs[0] > 1 / 3 > probs[1]


@pytest.mark.parametrize("loss", ALL_LOSSES, ids=lambda x: x.name)
def test_gradient_sign_matches_advantage(loss: PolicyLoss) -> None:
    current, behaviour, adv, mask = _batch(0, spread=0.05)  # ratios inside every clip/mask range
    g = _grad(loss, current, behaviour, adv, mask)
    # descending the loss raises logprob where A > 0: the loss gradient is -A * (positive)
    signs = torch.sign(-g) * torch.sign(adv)[:, None]
    assert bool((signs[mask > 0] > 0).all())
    assert bool((g[mask == 0] == 0).all())


# -- exact behaviour of each correction ------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 3.0))
def test_tis_clips_exactly_at_cap(seed: int, cap: float) -> None:
    current, behaviour, adv, mask = _batch(seed, spread=1.0)
    g = _grad(TruncatedIS(cap=cap), current, behaviour, adv, mask)
    ratio = torch.exp(current - behaviour)
    expected = (
        -torch.minimum(ratio, torch.tensor(cap, dtype=ratio.dtype))
        * adv[:, None]
        * mask
        / mask.sum()
    )
    torch.testing.assert_close(g, expected, rtol=1e-12, atol=1e-15)
    _, metrics = TruncatedIS(cap=cap)(current, behaviour, adv, mask)
    want = float(((ratio > cap).to(mask.dtype) * mask).sum() / mask.sum())
    assert metrics["off_policy/clipped_fraction"] == pytest.approx(want)


def test_on_policy_tis_is_reinforce() -> None:
    current, _, adv, mask = _batch(3)
    lp = current.clone().requires_grad_(True)
    loss, metrics = TruncatedIS(cap=1.5)(lp, current.clone(), adv, mask)
    reinforce = -(adv[:, None] * lp * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, reinforce)
    assert metrics["off_policy/ratio_mean"] == pytest.approx(1.0)
    assert metrics["off_policy/kl_behaviour"] == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.2, 0.9), st.floats(1.1, 4.0))
def test_icepop_masks_exactly_outside_interval(seed: int, low: float, high: float) -> None:
    current, behaviour, adv, mask = _batch(seed, spread=1.0)
    loss = IcePop(low=low, high=high)
    g = _grad(loss, current, behaviour, adv, mask)
    ratio = torch.exp(current - behaviour)
    inside = (ratio >= low) & (ratio <= high)
    # kept tokens: rho * A gradient; tokens outside [low, high]: exactly zero
    expected = -(inside * ratio * adv[:, None] * mask) / mask.sum()
    torch.testing.assert_close(g, expected, rtol=1e-12, atol=1e-15)
    assert bool((g[~inside] == 0).all())
    _, metrics = loss(current, behaviour, adv, mask)
    want = float(((~inside).to(mask.dtype) * mask).sum() / mask.sum())
    assert metrics["off_policy/masked_fraction"] == pytest.approx(want)


def _vanilla_ppo(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps: float
) -> torch.Tensor:
    r = torch.exp(lp - old)
    a = adv[:, None]
    obj = torch.min(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)
    return -(obj * mask).sum() / mask.sum()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 0.5))
def test_decoupled_ppo_equals_vanilla_when_proximal_is_behaviour(seed: int, eps: float) -> None:
    current, behaviour, adv, mask = _batch(seed, spread=0.5)
    loss = DecoupledPPO(clip_eps=eps)
    for prox in (None, behaviour.clone()):
        lp = current.clone().requires_grad_(True)
        out, _ = loss(lp, behaviour, adv, mask, proximal_logprobs=prox)
        ref_lp = current.clone().requires_grad_(True)
        ref = _vanilla_ppo(ref_lp, behaviour, adv, mask, eps)
        torch.testing.assert_close(out, ref)
        out.backward()
        ref.backward()
        assert lp.grad is not None and ref_lp.grad is not None
        torch.testing.assert_close(lp.grad, ref_lp.grad)


def test_decoupled_ppo_weights_by_proximal_over_behaviour() -> None:
    current, behaviour, adv, mask = _batch(5, spread=0.05)
    prox = current.detach().clone()  # at the start of the step current == proximal: r = 1
    g = _grad(
        DecoupledPPO(behaviour_cap=None), current, behaviour, adv, mask, proximal_logprobs=prox
    )
    w = torch.exp(prox - behaviour)
    torch.testing.assert_close(g, -w * adv[:, None] * mask / mask.sum())
    capped = _grad(
        DecoupledPPO(behaviour_cap=1.0), current, behaviour, adv, mask, proximal_logprobs=prox
    )
    torch.testing.assert_close(capped, -w.clamp(max=1.0) * adv[:, None] * mask / mask.sum())


# -- KL terms and metrics --------------------------------------------------------------


@pytest.mark.parametrize("loss_cls", [TruncatedIS, DecoupledPPO, IcePop])
def test_kl_to_reference_pulls_towards_reference(loss_cls: type) -> None:
    current, behaviour, _, mask = _batch(7)
    zero_adv = torch.zeros(current.shape[0], dtype=current.dtype)
    ref = current - 0.3  # reference assigns lower logprob to these tokens
    loss = loss_cls(kl_coef=0.5)
    lp = current.clone().requires_grad_(True)
    out, metrics = loss(lp, behaviour, zero_adv, mask, ref_logprobs=ref)
    out.backward()
    assert lp.grad is not None
    assert metrics["train/kl_ref"] > 0
    # the only force is the KL term: descending it lowers the logprob towards ref
    assert bool((lp.grad[mask > 0] > 0).all())


@pytest.mark.parametrize("loss", ALL_LOSSES, ids=lambda x: x.name)
def test_metrics(loss: PolicyLoss) -> None:
    current, behaviour, adv, mask = _batch(11, spread=0.5)
    out, metrics = loss(current, behaviour, adv, mask)
    assert METRIC_KEYS <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    ratio = torch.exp(current - behaviour)[mask > 0]
    assert metrics["off_policy/ratio_max"] == pytest.approx(float(ratio.max()))
    assert metrics["off_policy/ratio_mean"] == pytest.approx(float(ratio.mean()))
    k3 = float((ratio - 1 - torch.log(ratio)).mean())
    assert metrics["off_policy/kl_behaviour"] == pytest.approx(k3) and k3 > 0
    assert metrics["train/loss"] == pytest.approx(float(out))
    assert metrics["train/tokens"] == float(mask.sum())


def test_shape_errors_and_registry() -> None:
    current, behaviour, adv, mask = _batch(0)
    with pytest.raises(ValueError):
        TruncatedIS()(current, behaviour[:, :-1], adv, mask)
    with pytest.raises(ValueError):
        TruncatedIS()(current, behaviour, adv[:-1], mask)
    with pytest.raises(ValueError):
        DecoupledPPO()(current, behaviour, adv, mask, proximal_logprobs=current[:1])
    assert set(POLICY_LOSSES) == {"tis", "ppo-decoupled", "icepop"}
    for name in POLICY_LOSSES:
        assert isinstance(get_policy_loss(name), PolicyLoss) and get_policy_loss(name).name == name
    assert get_policy_loss("tis", cap=3.0) == TruncatedIS(cap=3.0)
    with pytest.raises(ConfigError):
        get_policy_loss("dpo")
    with pytest.raises(ConfigError):
        get_policy_loss("icepop", low=2.0)
    with pytest.raises(ConfigError):
        get_policy_loss("tis", bogus=1)


# -- advantages ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(-10, 10), min_size=1, max_size=8), min_size=1, max_size=6),
    st.booleans(),
)
def test_advantages_zero_mean_per_group(groups: list[list[float]], std: bool) -> None:
    rewards = torch.tensor([r for g in groups for r in g])
    ids = torch.tensor([i * 7 + 3 for i, g in enumerate(groups) for _ in g])  # arbitrary labels
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(len(rewards)))
    adv = group_advantages(rewards[perm], ids[perm], normalize_std=std)
    for label in ids.unique():
        sel = ids[perm] == label
        members = rewards[perm][sel]
        assert abs(float(adv[sel].sum())) <= 1e-3 * max(1.0, float(sel.sum()))
        if float(members.max() - members.min()) == 0:
            assert bool((adv[sel] == 0).all())
        elif std and len(members) > 1 and float(members.std(correction=0)) > 1e-3:
            assert float(adv[sel].std(correction=0)) == pytest.approx(1.0, rel=1e-2)
        if not std:
            torch.testing.assert_close(adv[sel], members - members.mean())


def test_advantages_matrix_form_matches_labels() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]])
    flat = group_advantages(rewards)
    ids = torch.arange(3).repeat_interleave(4)
    torch.testing.assert_close(flat, group_advantages(rewards.flatten(), ids))
    torch.testing.assert_close(flat[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    assert bool((flat[4:8] == 0).all())
    with pytest.raises(ValueError):
        group_advantages(rewards.flatten())
    with pytest.raises(ValueError):
        group_advantages(rewards.flatten(), ids[:-1])
