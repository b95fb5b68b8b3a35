"""The committed logprob: :func:`process_logits`, the one definition of ``log q``.

What is committed
-----------------
For every completion token a contributor commits ``log q(x_t)``: the
log-probability of the sampled token under the distribution it was actually
sampled from, defined by :func:`process_logits`:

1. ``s = float32(logits) / float32(temperature)`` over the full vocabulary V
   (the width of the model's output layer, padding rows included);
2. top-k (``top_k > 0``): keep the ``top_k`` largest ``s``;
3. top-p (``top_p < 1``): on the distribution renormalised after step 2, walk
   tokens from most to least probable and keep token r while the mass of the
   tokens strictly before it is ``< top_p`` (so the token that crosses
   ``top_p`` is kept, and at least one token always is);
4. ``log_softmax`` over the kept tokens; every other token gets ``-inf``.

Ties at a top-k or top-p boundary are broken by token id: the order is a stable
descending sort, so among equal logits the lower token id comes first and is
kept first. ``temperature == 0`` is greedy: the distribution is a point mass on
the argmax (lowest id among equal maxima) and the committed logprob is ``0.0``.
The validator's recomputation and the trainer's importance ratios use this
same definition.

Invariants: output is float32 of the input's shape, ``-inf`` exactly off the
support, and the kept set and its order do not depend on the device or on how
far the internal sorted prefix had to grow. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_NEG_INF = float("-inf")


def check_params(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ``ValueError`` unless the sampling parameters are well formed."""
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def scale_logits(logits: torch.Tensor | np.ndarray, temperature: float) -> torch.Tensor:
    """``float32(logits) / float32(temperature)`` (step 1 of the definition); temperature > 0."""
    x = torch.as_tensor(logits).to(torch.float32)
    return x / torch.tensor(float(temperature), dtype=torch.float32, device=x.device)


def process_logits(
    logits: torch.Tensor | np.ndarray, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Logits ``(..., V)`` -> float32 processed logprobs ``(..., V)``, ``-inf`` off support.

    Exactly the committed definition in the module docstring.
    """
    check_params(temperature, top_k, top_p)
    x = torch.as_tensor(logits).to(torch.float32)
    vocab = x.shape[-1]
    if temperature == 0.0:
        out = torch.full_like(x, _NEG_INF)
        return out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 0.0)
    s = scale_logits(x, temperature)
    top_k = top_k if 0 < top_k < vocab else 0
    if top_k == 0 and top_p >= 1.0:
        return torch.log_softmax(s, dim=-1)
    if top_k:
        vals = torch.topk(s, top_k, dim=-1).values  # (..., k) descending
        log_z = torch.logsumexp(vals, dim=-1, keepdim=True)
        n = torch.full_like(vals[..., :1], top_k, dtype=torch.int64)
        if top_p < 1.0:
            n = _nucleus_size(vals, log_z, top_p)
    else:
        vals, log_z, n = _nucleus_prefix(s, top_p)
    mask = _keep_first(s, n, vals)
    return torch.log_softmax(s.masked_fill(~mask, _NEG_INF), dim=-1)


def _nucleus_size(vals: torch.Tensor, log_z: torch.Tensor, top_p: float) -> torch.Tensor:
    """How many of the descending ``vals`` top-p keeps: mass strictly before < top_p."""
    probs = torch.exp(vals - log_z)
    return ((torch.cumsum(probs, dim=-1) - probs) < top_p).sum(dim=-1, keepdim=True)


def _nucleus_prefix(
    s: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p over the whole vocabulary from a sorted prefix long enough to hold it.

    The prefix grows until the mass before its last entry reaches ``top_p`` in
    every row, so the kept count equals a full sort's; the vocabulary is sorted
    only when the nucleus is that large.
    """
    vocab = s.shape[-1]
    log_z = torch.logsumexp(s, dim=-1, keepdim=True)
    width = min(vocab, 64)
    while True:
        vals = torch.topk(s, width, dim=-1).values  # (..., width) descending
        probs = torch.exp(vals - log_z)
        last_before = probs.sum(dim=-1) - probs[..., -1]
        if width == vocab or bool((last_before >= top_p).all()):
            return vals, log_z, _nucleus_size(vals, log_z, top_p)
        width = min(vocab, width * 8)


def _keep_first(s: torch.Tensor, n: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Mask of the first ``n`` tokens per row in (logit descending, token id ascending) order.

    ``vals`` holds the row's largest logits in descending order (at least n).
    Everything above the n-th value is kept; ties at it are filled by id.
    """
    nth = vals.gather(-1, n - 1)  # (..., 1)
    # Every logit above nth is among the fewer-than-n first entries of vals, so
    # the counts come from vals; only ties running past its end need the row.
    greater = (vals > nth).sum(dim=-1, keepdim=True)
    if bool((vals[..., -1:] == nth).any()):
        tied_total = (s == nth).sum(dim=-1, keepdim=True, dtype=torch.int64)
    else:
        tied_total = (vals == nth).sum(dim=-1, keepdim=True)
    if not bool((greater + tied_total > n).any()):
        return s >= nth
    tied = s == nth
    tied &= torch.cumsum(tied.to(torch.int64), dim=-1) <= n - greater
    return (s > nth) | tied
