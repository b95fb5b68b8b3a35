"""The committed logprob, the verifiable sampler, and sampling-integrity checks.

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

The verifiable sampler
----------------------
Token t of completion g is ``argmax_j (log q_t(j) + G_t(j))`` over the support,
where ``G_t`` is Gumbel noise drawn from a blake3 XOF keyed by the
contributor's public key over ``(nonce, seed, g, t)`` (:func:`gumbel_noise`).
That is an exact sample from ``q_t`` (Gumbel-max), and anyone who recomputes
``q_t`` can replay it. Uniforms are built from 64-bit words as float64 and the
noise is ``-log(-log(u))`` in float64, so the stream is platform independent up
to the last ulp of ``log``; the argmax is taken in float64.

Checks: what each catches, what it costs
----------------------------------------
CPU time per 1k tokens on one (shared) x86-64 core, for V = 32,768 / 151,936.
For scale, the teacher-forced forward pass of a 4-layer, 256-wide Llama costs
0.43 s / 1.36 s there; a 1.5B model costs ~100x more on a CPU and ~0.1 s on a
GPU. Every check below reuses the logits of that one forward pass.

* Logprob comparison (``verify.spotcheck.compare_chunk``): catches a wrong
  policy version, wrong temperature or filters in the committed numbers, and
  edited logprobs. Cost: the forward pass.
* :func:`support_check`: every sampled token lies in the claimed top-k/top-p
  support, with slack ``logit_tol``/``mass_tol`` for numerical noise. Catches
  looser filters than claimed and hand-inserted tokens. 0.27 s / 1.2 s.
* :func:`replay_check`: replays the verifiable sampler token by token. Catches
  every token that is not the Gumbel-max sample: hand-picked or cherry-picked
  tokens, greedy decoding, a wrong temperature or filter. Noise 0.44 s / 1.9 s
  (blake3 XOF, 8 bytes and two float64 logs per vocabulary entry) plus
  0.7-1.0 s / 3.6-4.5 s to compare; run on opened chunks only. ``eps`` buys
  slack for numerical noise and equally gives a cheater that much choice:
  with fp32 on both sides 1e-4 suffices (no honest token needed any); with
  bf16 generation and fp32 recomputation 1% of honest tokens are near-ties,
  up to a gap of 0.09, so eps must be ~0.2.
* :func:`pit_uniformity_test`: randomised PIT values pooled over many tokens
  of one contributor must be uniform (Kolmogorov-Smirnov); it needs no
  verifiable sampler. 0.8 s / 4.7 s for the values. Rejection rate at
  alpha = 1e-3 on synthetic LM-like logits (mean top probability 0.40 / 0.67):
  greedy or temperature 0.5 claimed as 1.0: 100% at 500 tokens in both;
  temperature 0.8: 92% / 30% at 500 tokens, 100% / 98% at 2,000; top-p 0.9
  claimed as 1.0: 78% / 8% at 500, 100% / 100% at 2,000; top-k 20: 100% at
  500 / 12% at 2,000 (little mass lives in the tail it cuts). Honest false
  positives: 5.3% at alpha = 0.05 over 1,000 runs.

Error convention: a failed check raises :class:`~verify.errors.SpotCheckError`
whose ``expected`` is the contributor's claim and ``computed`` the validator's
recomputation; ``position`` is set on the exception.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from verify.errors import Reason, SpotCheckError
from verify.hashing import blake3_keyed_stream

SAMPLER_GUMBEL = b"prooftrain/v1/sampler/gumbel"
SAMPLER_PIT = b"prooftrain/v1/sampler/pit"
SAMPLER_KEY_SIZE = 32
_NEG_INF = float("-inf")


def check_params(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ``ValueError`` unless the sampling parameters are well formed."""
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _scaled(logits: torch.Tensor | np.ndarray, temperature: float) -> torch.Tensor:
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
    s = _scaled(x, temperature)
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


def _gumbel_stream(key: bytes, nonce: bytes, seed: int, position: int, vocab: int,
                   sample_index: int) -> bytes:
    if len(key) != SAMPLER_KEY_SIZE:
        raise ValueError(f"sampler key must be {SAMPLER_KEY_SIZE} bytes, got {len(key)}")
    if vocab <= 0 or position < 0 or sample_index < 0 or not 0 <= seed < 2**64:
        raise ValueError("vocab must be > 0 and seed, position, sample_index non-negative")
    head = struct.pack("<I", len(nonce)) + nonce
    tail = struct.pack("<QIQ", seed, sample_index, position)
    return blake3_keyed_stream(key, SAMPLER_GUMBEL, head, tail, length=8 * vocab)


def _gumbel(raw: bytes, rows: int, vocab: int) -> torch.Tensor:
    """The Gumbel transform of concatenated streams -> ``(rows, vocab)`` float64."""
    words = np.frombuffer(raw, dtype="<u8").reshape(rows, vocab)
    u = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)
    return torch.from_numpy(-np.log(-np.log(u)))


def noise_for_positions(
    key: bytes, nonce: bytes, seed: int, positions: range | list[int], vocab: int,
    *, sample_index: int = 0,
) -> torch.Tensor:
    """:func:`gumbel_noise` for several positions -> ``(T, vocab)`` float64, row t equal to
    ``gumbel_noise(..., positions[t], ...)``."""
    return noise_for_streams([(key, nonce, seed, sample_index, positions)], vocab)


NoiseSpec = tuple[bytes, bytes, int, int, "range | list[int]"]
"""``(key, nonce, seed, sample_index, positions)`` of one completion."""


def noise_for_streams(specs: list[NoiseSpec], vocab: int) -> torch.Tensor:
    """:func:`noise_for_positions` of several completions stacked -> ``(sum T, vocab)``."""
    raw = b"".join(_gumbel_stream(key, nonce, seed, p, vocab, index)
                   for key, nonce, seed, index, positions in specs for p in positions)
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


def _as_tokens(token_ids: torch.Tensor | np.ndarray | list[int], n: int) -> torch.Tensor:
    tokens = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
    if tokens.ndim != 1 or tokens.shape[0] != n:
        raise SpotCheckError(
            "token count does not match recomputed positions",
            reason=Reason.INCONSISTENT, expected=int(tokens.numel()), computed=n,
        )
    return tokens


def _raise(
    reason: Reason, message: str, position: int, expected: object, computed: object
) -> NoReturn:
    err = SpotCheckError(
        f"{message} at position {position}", reason=reason, expected=expected, computed=computed
    )
    err.position = position  # type: ignore[attr-defined]
    raise err


def relaxed_support(
    logits: torch.Tensor | np.ndarray, token_ids: torch.Tensor | np.ndarray | list[int],
    temperature: float, top_k: int, top_p: float, *, logit_tol: float, mass_tol: float,
    position_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position: is ``token_ids[t]`` in the support up to numerical slack?

    Token x passes when fewer than ``top_k`` tokens have a scaled logit above
    ``s_x + logit_tol``, and the top-k mass of those tokens is below
    ``top_p + mass_tol`` (greedy: raw logit within ``logit_tol`` of the max).
    The relaxed support always contains the strict one. Returns
    ``(ok (T,) bool, ahead (T,) int64, mass_ahead (T,) float64)``.
    """
    check_params(temperature, top_k, top_p)
    x = torch.as_tensor(logits).to(torch.float32)  # (T, V)
    tokens = _as_tokens(token_ids, x.shape[0])
    vocab = x.shape[-1]
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        bad = int(torch.nonzero((tokens < 0) | (tokens >= vocab))[0, 0])
        _raise(Reason.TOKEN_OUTSIDE_SUPPORT, "token id out of vocabulary",
               position_offset + bad, int(tokens[bad]), vocab)
    s = x if temperature == 0.0 else _scaled(x, temperature)
    s_x = s.gather(-1, tokens[:, None])  # (T, 1)
    finite = torch.isfinite(s_x[:, 0])
    ahead_mask = s > s_x + logit_tol  # (T, V)
    ahead = ahead_mask.sum(dim=-1, dtype=torch.int64)
    if temperature == 0.0:
        return finite & (ahead == 0), ahead, torch.zeros(len(tokens), dtype=torch.float64)
    ok = finite.clone()
    if 0 < top_k < vocab:
        ok &= ahead < top_k
    mass_ahead = torch.zeros(len(tokens), dtype=torch.float64)
    if top_p < 1.0:
        # Tokens ahead of x are inside the top-k whenever there are fewer than k
        # of them, so their top-k probabilities only need the top-k normaliser.
        top = torch.topk(s, top_k, dim=-1).values if 0 < top_k < vocab else s
        log_z = torch.logsumexp(top, dim=-1)
        lead = top.masked_fill(top <= s_x + logit_tol, _NEG_INF)
        mass_ahead = torch.exp(torch.logsumexp(lead, dim=-1) - log_z).to(torch.float64)
        ok &= mass_ahead < top_p + mass_tol
    return ok, ahead, mass_ahead


def support_check(
    token_ids: torch.Tensor | np.ndarray | list[int], logits: torch.Tensor | np.ndarray,
    temperature: float, top_k: int, top_p: float, *,
    logit_tol: float = 1e-3, mass_tol: float = 1e-4, position_offset: int = 0,
) -> None:
    """Raise ``TOKEN_OUTSIDE_SUPPORT`` at the first token outside the relaxed support."""
    ok, ahead, mass = relaxed_support(
        logits, token_ids, temperature, top_k, top_p, logit_tol=logit_tol, mass_tol=mass_tol,
        position_offset=position_offset,
    )
    if bool(ok.all()):
        return
    t = int(torch.nonzero(~ok)[0, 0])
    _raise(Reason.TOKEN_OUTSIDE_SUPPORT, "sampled token outside the claimed support",
           position_offset + t,
           f"top_k={top_k} top_p={top_p} temperature={temperature}",
           f"{int(ahead[t])} tokens ahead, mass ahead {float(mass[t]):.6g}")


@dataclass(frozen=True)
class ReplayStats:
    """Result of a passing :func:`replay_check`."""

    tokens: int
    exact: int
    """Positions where the claimed token is exactly the replayed argmax."""
    max_gap: float
    """Largest score gap accepted as numerical noise (0 when every token was exact)."""


def replay_check(
    token_ids: torch.Tensor | np.ndarray | list[int], logits: torch.Tensor | np.ndarray,
    temperature: float, top_k: int, top_p: float, noise: torch.Tensor, *,
    eps: float = 1e-4, logit_tol: float = 1e-3, mass_tol: float = 1e-4, position_offset: int = 0,
) -> ReplayStats:
    """Replay the verifiable sampler on recomputed ``logits (T, V)`` with ``noise (T, V)``.

    Accept the claimed token when it is the replayed argmax, or when it lies in
    the relaxed support and its score ``log q + G`` is within ``eps`` of the
    argmax's (numerical noise between the two forward passes; ``eps`` should be
    about twice the per-token logprob tolerance). Greedy positions accept any
    token whose raw logit is within ``logit_tol`` of the max. Otherwise raise
    ``SAMPLER_REPLAY_MISMATCH`` naming the position and both tokens.
    """
    lp = process_logits(logits, temperature, top_k, top_p)  # (T, V) float32
    if tuple(noise.shape) != tuple(lp.shape):
        raise ValueError(f"noise shape {tuple(noise.shape)} != logits shape {tuple(lp.shape)}")
    tokens = _as_tokens(token_ids, lp.shape[0])
    relaxed, _, _ = relaxed_support(
        logits, tokens, temperature, top_k, top_p, logit_tol=logit_tol, mass_tol=mass_tol,
        position_offset=position_offset,
    )
    expected = sample_verifiable(lp, noise)  # (T,)
    exact = tokens == expected
    if temperature == 0.0:
        gap = torch.zeros(len(tokens), dtype=torch.float64)
        accept = exact | relaxed
    else:
        # Every log-normaliser cancels in a score difference, so the gap is taken
        # on scaled logits; that keeps it defined for a token just outside the
        # strict support.
        s = _scaled(logits, temperature)
        pair = torch.stack([expected, tokens], dim=-1)  # (T, 2)
        score = s.gather(-1, pair).to(torch.float64) + noise.gather(-1, pair)
        gap = score[:, 0] - score[:, 1]
        accept = exact | (relaxed & (gap <= eps))
    if not bool(accept.all()):
        t = int(torch.nonzero(~accept)[0, 0])
        why = (f"score gap {float(gap[t]):.6g} > eps {eps}" if bool(relaxed[t])
               else "token outside the claimed support")
        _raise(Reason.SAMPLER_REPLAY_MISMATCH, f"token is not the replayed sample ({why})",
               position_offset + t, int(tokens[t]), int(expected[t]))
    near = gap[~exact]
    return ReplayStats(
        tokens=len(tokens), exact=int(exact.sum()),
        max_gap=float(near.max()) if near.numel() else 0.0,
    )


def pit_randomizer(key: bytes, label: bytes, count: int) -> np.ndarray:
    """``count`` float64 uniforms in (0, 1) from a keyed blake3 stream.

    ``key`` must be unknown to the contributor when it commits (the validator's
    epoch secret); ``label`` names the envelope and chunk.
    """
    if len(key) != SAMPLER_KEY_SIZE:
        raise ValueError(f"PIT key must be {SAMPLER_KEY_SIZE} bytes")
    raw = blake3_keyed_stream(key, SAMPLER_PIT, struct.pack("<I", len(label)), label,
                              length=8 * count)
    words = np.frombuffer(raw, dtype="<u8")
    return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)


def pit_values(
    token_ids: torch.Tensor | np.ndarray | list[int], processed_logprobs: torch.Tensor,
    randomizer: np.ndarray,
) -> np.ndarray:
    """Randomised PIT ``u_t = F_t(x_t^-) + V_t * q_t(x_t)`` -> float64 ``(T,)``.

    Tokens are ordered from most to least probable (ties: lower id first), so
    F is the mass of tokens more probable than x. Under honest sampling the
    u_t are i.i.d. uniform on (0, 1) (the Rosenblatt transform); greedy or
    colder sampling piles them near 0, hotter sampling near 1, and truncation
    empties the top of the interval.
    """
    lp = torch.as_tensor(processed_logprobs).to(torch.float64)  # (T, V)
    tokens = _as_tokens(token_ids, lp.shape[0])
    p = torch.exp(lp)
    p_x = p.gather(-1, tokens[:, None])  # (T, 1)
    ids = torch.arange(lp.shape[-1])[None, :]
    before = (p > p_x) | ((p == p_x) & (ids < tokens[:, None]))
    f_before = (p * before).sum(dim=-1)
    v = torch.as_tensor(np.asarray(randomizer, dtype=np.float64))
    return (f_before + v * p_x[:, 0]).clamp(0.0, 1.0).numpy()


@dataclass(frozen=True)
class KsResult:
    """One-sample Kolmogorov-Smirnov test of PIT values against U(0, 1)."""

    n: int
    statistic: float
    p_value: float


def _kolmogorov_sf(lam: float) -> float:
    if lam < 0.2:
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, 2.0 * total))


def ks_uniform(u: np.ndarray) -> KsResult:
    """KS statistic and p-value (asymptotic, Stephens' small-n correction)."""
    x = np.sort(np.asarray(u, dtype=np.float64).ravel())
    n = x.size
    if n == 0:
        raise ValueError("KS test needs at least one value")
    i = np.arange(1, n + 1, dtype=np.float64)
    d = float(max(np.max(i / n - x), np.max(x - (i - 1) / n)))
    root = math.sqrt(n)
    return KsResult(n=n, statistic=d, p_value=_kolmogorov_sf((root + 0.12 + 0.11 / root) * d))


def pit_uniformity_test(u: np.ndarray, *, alpha: float = 1e-3) -> KsResult:
    """Raise ``SAMPLING_DISTRIBUTION`` when pooled PIT values reject uniformity at ``alpha``.

    ``alpha`` is the false-positive rate per test for an honest contributor.
    """
    result = ks_uniform(u)
    if result.p_value < alpha:
        raise SpotCheckError(
            f"sampled tokens are not distributed as claimed over {result.n} tokens "
            f"(KS D={result.statistic:.4f})",
            reason=Reason.SAMPLING_DISTRIBUTION, expected=f"p >= {alpha}",
            computed=result.p_value,
        )
    return result
