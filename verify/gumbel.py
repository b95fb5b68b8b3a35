"""The verifiable sampler: keyed Gumbel noise and the Gumbel-max sample.

The verifiable sampler
----------------------
Token t of completion g is ``argmax_j (log q_t(j) + G_t(j))`` over the support,
where ``G_t`` is Gumbel noise drawn from a blake3 XOF keyed by the
contributor's public key over ``(nonce, seed, g, t)`` (:func:`gumbel_noise`).
That is an exact sample from ``q_t`` (Gumbel-max), and anyone who recomputes
``q_t`` can replay it. Uniforms are built from 64-bit words as float64 and the
noise is ``-log(-log(u))`` in float64, so the stream is platform independent up
to the last ulp of ``log``; the argmax is taken in float64.

Invariants: the noise for ``(key, nonce, seed, sample_index, position)`` is a
pure function of those values and ``vocab`` (the byte stream below is the
specification; it never changes within a sampler domain), rows of the batched
functions equal the single-token :func:`gumbel_noise`, and the sample is the
lowest token id among exactly equal maxima. Pure: no I/O.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from verify.hashing import blake3_keyed_stream

SAMPLER_GUMBEL = b"prooftrain/v1/sampler/gumbel"
SAMPLER_KEY_SIZE = 32


def gumbel_noise(
    key: bytes, nonce: bytes, seed: int, position: int, vocab: int, *, sample_index: int = 0
) -> torch.Tensor:
    """Float64 Gumbel(0, 1) noise ``(vocab,)`` for one token of one completion.

    Stream: blake3 keyed by ``key`` (32 bytes; the contributor's public key) over
    ``SAMPLER_GUMBEL || 0x00 || u32 len(nonce) || nonce || u64 seed ||
    u32 sample_index || u64 position`` (little-endian), XOF output of
    ``8 * vocab`` bytes read as little-endian uint64 words w_j;
    ``u_j = ((w_j >> 11) + 0.5) / 2**53`` lies strictly in (0, 1) and is exact
    in float64; ``G_j = -log(-log(u_j))``. ``position`` counts completion tokens
    from 0; ``sample_index`` is the completion's index in its group.
    """
    return _gumbel(_gumbel_stream(key, nonce, seed, position, vocab, sample_index), 1, vocab)[0]


def sampler_stream(
    domain: bytes,
    key: bytes,
    nonce: bytes,
    seed: int,
    position: int,
    sample_index: int,
    length: int,
) -> bytes:
    """``length`` bytes of a verifiable sampler's randomness for one token: blake3 keyed by
    ``key`` over ``domain || 0x00 || u32 len(nonce) || nonce || u64 seed || u32 sample_index
    || u64 position`` (little-endian). Every sampler (``verify.samplers``) draws from it."""
    if len(key) != SAMPLER_KEY_SIZE:
        raise ValueError(f"sampler key must be {SAMPLER_KEY_SIZE} bytes, got {len(key)}")
    if position < 0 or sample_index < 0 or not 0 <= seed < 2**64:
        raise ValueError("seed, position and sample_index must be non-negative")
    head = struct.pack("<I", len(nonce)) + nonce
    tail = struct.pack("<QIQ", seed, sample_index, position)
    return blake3_keyed_stream(key, domain, head, tail, length=length)


def _gumbel_stream(
    key: bytes, nonce: bytes, seed: int, position: int, vocab: int, sample_index: int
) -> bytes:
    if vocab <= 0:
        raise ValueError(f"vocab must be > 0, got {vocab}")
    return sampler_stream(SAMPLER_GUMBEL, key, nonce, seed, position, sample_index, 8 * vocab)


def _gumbel(raw: bytes, rows: int, vocab: int) -> torch.Tensor:
    """The Gumbel transform of concatenated streams -> ``(rows, vocab)`` float64."""
    words = np.frombuffer(raw, dtype="<u8").reshape(rows, vocab)
    u = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)
    return torch.from_numpy(-np.log(-np.log(u)))


def noise_for_positions(
    key: bytes,
    nonce: bytes,
    seed: int,
    positions: range | list[int],
    vocab: int,
    *,
    sample_index: int = 0,
) -> torch.Tensor:
    """:func:`gumbel_noise` for several positions -> ``(T, vocab)`` float64, row t equal to
    ``gumbel_noise(..., positions[t], ...)``."""
    return noise_for_streams([(key, nonce, seed, sample_index, positions)], vocab)


NoiseSpec = tuple[bytes, bytes, int, int, "range | list[int]"]
"""``(key, nonce, seed, sample_index, positions)`` of one completion."""


def noise_for_streams(specs: list[NoiseSpec], vocab: int) -> torch.Tensor:
    """:func:`noise_for_positions` of several completions stacked -> ``(sum T, vocab)``."""
    raw = b"".join(
        _gumbel_stream(key, nonce, seed, p, vocab, index)
        for key, nonce, seed, index, positions in specs
        for p in positions
    )
    if not raw:
        return torch.empty((0, vocab), dtype=torch.float64)
    return _gumbel(raw, len(raw) // (8 * vocab), vocab)


def sample_verifiable(processed_logprobs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sample: ``argmax(logprob + noise)`` in float64 over ``(..., V)``.

    Off-support entries are ``-inf`` and never win; among exactly equal scores
    the lowest token id wins (``torch.argmax`` returns the first maximum).
    """
    scores = processed_logprobs.to(torch.float64) + noise.to(processed_logprobs.device)
    return scores.argmax(dim=-1)
