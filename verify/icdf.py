"""The inverse-CDF verifiable sampler: one keyed uniform per token.

Token t of completion g is the inverse CDF of the committed distribution
``q_t`` (``verify.logprobs.process_logits``) at a keyed uniform ``u_t``, with
tokens in id order::

    p_j   = exp(log q_t(j))                   (float32; 0 off the support)
    C_j   = p_0 + ... + p_j                   (float64 running sum, id order)
    x_t   = the smallest j with C_j > u_t * C_{V-1}

(the sum runs over blocks of ``BLOCK`` ids: block totals, then the running sum
within the one block the target falls in, so a draw costs one pass over the
vocabulary).

``u_t`` comes from a blake3 XOF keyed by the contributor's public key over
``(nonce, seed, g, t)`` (:func:`icdf_uniforms`), so nobody else can steer a
contributor's draws and anyone who recomputes ``q_t`` replays them. That is an
exact sample from ``q_t`` (inverse transform sampling), at the cost of one
hash per token and one pass over the vocabulary, against one hash output and
two logarithms per vocabulary entry for the Gumbel-max sampler
(``verify.gumbel``).

Replay (:func:`icdf_replay`) accepts the claimed token x when the scaled
uniform ``u_t * C_{V-1}`` lies in x's recomputed interval
``[C_{x-1}, C_x)`` widened by ``slack`` on each side (numerical noise between
the contributor's and the validator's forward passes moves interval
boundaries by at most the distributions' L1 distance). The choice ``slack``
leaves a contributor is a neighbouring token *in id order*, and only when its
uniform falls within ``slack`` of a boundary: a token with no relation to
meaning, not the most probable one.

Invariants: the uniform for ``(key, nonce, seed, sample_index, position)``
is a pure function of those values (the byte stream below is the
specification); a draw is a pure function of ``q_t`` and ``u_t``; tokens off
the support have empty intervals and are never drawn or accepted. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verify.gumbel import sampler_stream
from verify.logprobs import process_logits

SAMPLER_ICDF = b"prooftrain/v1/sampler/icdf"

IcdfSpec = tuple[bytes, bytes, int, int, "range | Sequence[int]"]
"""``(key, nonce, seed, sample_index, positions)`` of one completion."""


def icdf_uniform(
    key: bytes, nonce: bytes, seed: int, position: int, *, sample_index: int = 0
) -> float:
    """The keyed uniform in (0, 1) of one token.

    Stream: blake3 keyed by ``key`` (32 bytes; the contributor's public key) over
    ``SAMPLER_ICDF || 0x00 || u32 len(nonce) || nonce || u64 seed || u32 sample_index
    || u64 position`` (little-endian); its first 8 output bytes read as a
    little-endian uint64 w give ``u = ((w >> 11) + 0.5) / 2**53``, exact in float64.
    """
    word = int.from_bytes(
        sampler_stream(SAMPLER_ICDF, key, nonce, seed, position, sample_index, 8), "little"
    )
    return ((word >> 11) + 0.5) * 2.0**-53


def icdf_uniforms(specs: Sequence[IcdfSpec]) -> torch.Tensor:
    """:func:`icdf_uniform` of every position of several completions -> float64 ``(sum T,)``."""
    out = [
        icdf_uniform(key, nonce, seed, p, sample_index=index)
        for key, nonce, seed, index, positions in specs
        for p in positions
    ]
    return torch.tensor(out, dtype=torch.float64)


BLOCK = 1024
"""Tokens per block of the running sum: block sums first, then one block's running sum."""


def _blocks(processed_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p (n, nb, B) float32 masses in id order, zero-padded; S (n, nb) float64 running
    sums of the block totals)``, ``B = min(BLOCK, V)``: ``C_j = S_{b-1} + p_{bB} + ... + p_j``
    for j in block b."""
    n, vocab = processed_logprobs.shape
    width = min(BLOCK, vocab)
    pad = -vocab % width
    p = torch.exp(processed_logprobs.to(torch.float32))
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    p = p.view(n, -1, width)
    return p, torch.cumsum(p.sum(dim=-1, dtype=torch.float64), dim=-1)


def _within(p: torch.Tensor, sums: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``C`` over block ``block[i]`` of each row -> float64 ``(n, B)``."""
    rows = torch.arange(p.shape[0], device=p.device)
    before = torch.where(
        block > 0,
        sums.gather(-1, (block - 1).clamp(min=0)[:, None])[:, 0],
        torch.zeros_like(sums[:, 0]),
    )
    return before[:, None] + torch.cumsum(p[rows, block].to(torch.float64), dim=-1)


CHUNK_ENTRIES = 1 << 20
"""Logprobs handled at once (rows x V), so temporaries stay in cache and memory is bounded."""


def _by_rows(fn, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``fn`` over slices of rows of every tensor (``CHUNK_ENTRIES`` entries of the widest at a
    time), results concatenated."""
    n, width = tensors[0].shape[0], max(t.shape[-1] if t.ndim > 1 else 1 for t in tensors)
    rows = max(1, CHUNK_ENTRIES // width)
    if n <= rows:
        return fn(*tensors)
    return torch.cat([fn(*(t[i : i + rows] for t in tensors)) for i in range(0, n, rows)])


def sample_icdf(processed_logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF sample of each row of ``processed_logprobs (n, V)`` at ``uniforms (n,)``:
    the smallest id whose running sum exceeds ``u * total`` -> int64 ``(n,)``.

    Masses are ``exp`` in float32 of the float32 logprobs, summed in float64, blocks of
    ``BLOCK`` ids at a time (one pass over the vocabulary, then one block)."""
    return _by_rows(_sample_rows, processed_logprobs, uniforms.to(processed_logprobs.device))


def _sample_rows(processed_logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    p, sums = _blocks(processed_logprobs)
    target = uniforms.to(device=sums.device, dtype=torch.float64) * sums[:, -1]
    width = p.shape[-1]
    block = (sums <= target[:, None]).sum(dim=-1).clamp(max=sums.shape[-1] - 1)
    inner = (_within(p, sums, block) <= target[:, None]).sum(dim=-1).clamp(max=width - 1)
    return (block * width + inner).clamp(max=processed_logprobs.shape[-1] - 1)


def icdf_gaps(
    token_ids: torch.Tensor, processed_logprobs: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """How far each scaled uniform lies outside its claimed token's interval, in probability
    mass -> float64 ``(n,)``: 0 inside ``[C_{x-1}, C_x)``, else the distance to the nearer
    end (for a token off the support, whose interval is empty, the distance to where it
    would start; the caller's support check decides whether such a token may pass)."""
    device = processed_logprobs.device
    return _by_rows(_gap_rows, token_ids.to(device), processed_logprobs, uniforms.to(device))


def _gap_rows(
    token_ids: torch.Tensor, processed_logprobs: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    p, sums = _blocks(processed_logprobs)
    x = token_ids.to(device=sums.device, dtype=torch.long)
    width = p.shape[-1]
    hi = _within(p, sums, x // width).gather(-1, (x % width)[:, None])[:, 0]
    lo = hi - p.view(p.shape[0], -1).gather(-1, x[:, None])[:, 0].to(torch.float64)
    target = uniforms.to(device=sums.device, dtype=torch.float64) * sums[:, -1]
    inside = (target >= lo) & (target < hi)
    gap = torch.clamp(lo - target, min=0.0) + torch.clamp(target - hi, min=0.0)
    return torch.where(inside, torch.zeros_like(gap), gap)


def icdf_tokens(
    logits: torch.Tensor | np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """:func:`sample_icdf` of raw logits under the committed definition (greedy: the argmax)."""
    lp = process_logits(logits, temperature, top_k, top_p)
    if temperature == 0.0:
        return lp.argmax(dim=-1)
    return sample_icdf(lp, uniforms)
