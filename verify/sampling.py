"""The committed logprob, the verifiable sampler, and sampling-integrity checks.

Every name below is importable from this module; the code lives in:

* ``verify.logprobs``: what is committed. For every completion token a
  contributor commits ``log q(x_t)``, the log-probability of the sampled token
  under the distribution it was actually sampled from, defined by
  :func:`process_logits` (temperature, then top-k, then top-p, ties broken by
  token id; the numbered definition is that module's docstring). The
  validator's recomputation and the trainer's importance ratios use this same
  definition.
* ``verify.samplers``: the verifiable samplers by name, the one an
  assignment names. ``icdf-v1`` (``verify.icdf``, the default): token t of
  completion g is the inverse CDF of ``q_t`` in id order at one uniform from a
  blake3 stream keyed by the contributor's public key over ``(nonce, seed, g,
  t)``. ``gumbel-v1`` (``verify.gumbel``): ``argmax_j (log q_t(j) + G_t(j))``
  with keyed Gumbel noise per vocabulary entry (:func:`gumbel_noise`). Both
  are exact samples from ``q_t`` that anyone who recomputes ``q_t`` can
  replay; at a 49,152-token vocabulary the inverse-CDF draw costs about 2% of
  a 135M model's forward pass per token on one CPU core (``python
  bench/sampler.py``).
* ``verify.sampler_checks``: :func:`support_check` and :func:`replay_check`.
* ``verify.pit``: :func:`pit_values` and :func:`pit_uniformity_test`.

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

from verify.gumbel import (
    SAMPLER_GUMBEL,
    SAMPLER_KEY_SIZE,
    NoiseSpec,
    gumbel_noise,
    noise_for_positions,
    noise_for_streams,
    sample_verifiable,
)
from verify.logprobs import check_params, process_logits
from verify.pit import (
    SAMPLER_PIT,
    KsResult,
    ks_uniform,
    pit_randomizer,
    pit_uniformity_test,
    pit_values,
)
from verify.sampler_checks import ReplayStats, relaxed_support, replay_check, support_check

__all__ = [
    "SAMPLER_GUMBEL",
    "SAMPLER_KEY_SIZE",
    "SAMPLER_PIT",
    "KsResult",
    "NoiseSpec",
    "ReplayStats",
    "check_params",
    "gumbel_noise",
    "ks_uniform",
    "noise_for_positions",
    "noise_for_streams",
    "pit_randomizer",
    "pit_uniformity_test",
    "pit_values",
    "process_logits",
    "relaxed_support",
    "replay_check",
    "sample_verifiable",
    "support_check",
]
