"""Trust-core throughput: full envelope verification against raw Ed25519 verification.

Prints one JSON object on its last line:
  envelope_verifies_per_s   signature + commitment recomputed from the body + limits,
                            1,024-token rollouts, one core
  ed25519_verifies_per_s    raw PyNaCl verify of a message of the header's size, same run
  ratio                     envelope / raw (target >= 0.5)
  commitment_overhead_bytes_per_token   wire bytes the commitment adds (root field) per token
  envelope_overhead_bytes_per_token     all bytes beyond token ids and logprobs, per token
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._util import best_rate, emit, pin_one_core  # noqa: E402
from verify.envelope import build_envelope, verify_envelope  # noqa: E402
from verify.hashing import SIG_ROLLOUT_HEADER, signing_message  # noqa: E402
from verify.keys import SigningKey  # noqa: E402
from verify.types import SamplingParams, canonical_bytes  # noqa: E402

TOKENS = 1_024
OPS = 400


def main() -> None:
    pin_one_core()
    rng = np.random.default_rng(0)
    key = SigningKey.from_seed(bytes(range(32)))
    fields = dict(
        policy_version=7,
        manifest_digest=os.urandom(32),
        task_id="arithmetic",
        prompt_id="heldout/17",
        prompt_digest=os.urandom(32),
        assignment_id=os.urandom(16),
        nonce=os.urandom(32),
        sampling=SamplingParams(1.0, 1.0, 0, TOKENS, 1234),
        group_index=0,
        group_size=8,
        created_at_ms=1_764_000_000_000,
    )
    tokens = rng.integers(0, 50_000, TOKENS)
    logprobs = -rng.exponential(1.0, TOKENS)
    envelope = build_envelope(key, fields, tokens, logprobs, chunk_size=32)
    raw = canonical_bytes(envelope)
    message = signing_message(SIG_ROLLOUT_HEADER, envelope.header)
    public = key.public

    verify_envelope(raw)  # warm up and check it verifies
    rates_env, rates_raw = [], []
    for _ in range(3):  # interleave so both see the same machine load
        rates_raw.append(best_rate(lambda: public.verify(message, envelope.signature), OPS))
        rates_env.append(best_rate(lambda: verify_envelope(raw), OPS))
    env_rate, raw_rate = max(rates_env), max(rates_raw)

    empty_root_header = len(envelope.header) - (32 + 2)  # bin8 prefix (2 bytes) + 32-byte root
    commitment_bytes = len(envelope.header) - empty_root_header
    payload = 8 * TOKENS
    emit(
        {
            "bench": "trust_core",
            "tokens_per_rollout": TOKENS,
            "envelope_verifies_per_s": round(env_rate, 1),
            "ed25519_verifies_per_s": round(raw_rate, 1),
            "ratio": round(env_rate / raw_rate, 3),
            "ratio_target": 0.5,
            "commitment_overhead_bytes_per_token": round(commitment_bytes / TOKENS, 4),
            "envelope_overhead_bytes_per_token": round((len(raw) - payload) / TOKENS, 4),
            "envelope_bytes": len(raw),
        }
    )


if __name__ == "__main__":
    main()
