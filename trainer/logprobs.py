"""Teacher-forced token logprobs from logits, at every position or at chosen ones.

The trainer's RL loss reads logprobs only at completion tokens, so a training
step applies the LM head at those positions alone (:func:`kept_positions`,
``trainer.stages.Stage.forward``'s ``keep``) and holds (B, K, V) logits, K the
longest completion, instead of (B, T, V) over prompt and padding too. Both
functions here are ``verify.sampling.process_logits`` without top-k/top-p, so
validator and trainer agree.
"""

from __future__ import annotations

import torch

from verify.errors import ConfigError
from verify.sampling import process_logits


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Teacher-forced log-probabilities of each next token.

    ``logits`` (B, T, V) at position t predict ``input_ids[:, t+1]``; returns
    ``log_softmax(float32(logits[:, t]) / temperature)[input_ids[:, t+1]]``,
    float32, shape (B, T-1), aligned with ``input_ids[:, 1:]``. This is
    ``verify.sampling.process_logits`` without top-k/top-p, so validator and
    trainer agree. Differentiable.
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    lp = process_logits(logits[:, :-1], temperature, 0, 1.0)  # (B, T-1, V)
    targets = input_ids[:, 1:].to(logits.device).unsqueeze(-1)  # (B, T-1, 1)
    return lp.gather(-1, targets).squeeze(-1)


def kept_positions(target_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions whose logprobs a loss reads: ``(index, valid)``, both (B, K).

    ``K`` is the most non-zero entries of ``target_mask`` (B, T-1) in any row (at least
    1). Row b's ``index`` lists its target positions first, ascending, then other
    positions of the row, all distinct; ``valid`` marks the former. Prompt and padding
    positions beyond the K slots never reach the head, so a step holds (B, K, V) logits,
    not (B, T, V).
    """
    live = target_mask != 0  # (B, T-1)
    k = min(max(1, int(live.sum(1).max())) if live.numel() else 1, live.shape[1])
    order = torch.sort((~live).to(torch.uint8), dim=1, stable=True).indices  # targets first
    index = order[:, :k]  # (B, K)
    return index, live.gather(1, index)


def token_logprobs_at(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`token_logprobs` from the logits at ``index`` only.

    ``logits`` (B, K, V) at positions ``index`` (B, K) of :func:`kept_positions`; returns
    (B, T-1) float32 with the logprob of ``input_ids[:, t+1]`` where ``valid`` and 0
    elsewhere: equal to ``token_logprobs(full logits)`` at the valid positions (up to
    float rounding). Differentiable.
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    index, valid = index.to(logits.device), valid.to(logits.device)
    lp = process_logits(logits, temperature, 0, 1.0)  # (B, K, V)
    targets = input_ids[:, 1:].to(logits.device).gather(1, index)  # (B, K)
    picked = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, K)
    picked = torch.where(valid, picked, torch.zeros_like(picked))
    out = picked.new_zeros((input_ids.shape[0], input_ids.shape[1] - 1))  # (B, T-1)
    return out.scatter(1, index, picked)  # index is distinct within a row
