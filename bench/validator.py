"""Validator benchmark: admission over loopback HTTP, spot-check cost, latency.

Prints progress on stderr and one JSON object on the last line of stdout:

  admitted_groups_per_s      groups admitted per second over HTTP on 127.0.0.1,
                             audit rate 0 (G envelopes of TOKENS tokens each)
  admitted_envelopes_per_s   the same in envelopes
  envelope_verifies_per_s    trust-core verification of the same envelopes, same run
  admission_ratio            admitted_envelopes_per_s / envelope_verifies_per_s (target >= 0.5)
  admission_p99_ms           99th percentile of submit latency seen by the clients
  spotcheck_cost_ratio       recomputation (spot check) time / generation time for the same
                             rollouts on the same model (target <= 0.35)

    python bench/validator.py [--groups 200] [--group-size 8] [--tokens 1024] [--clients 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._util import best_rate, emit  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_dir(work: Path) -> Path:
    """The demo base model if it can be had, else a tiny random model."""
    try:
        from trainer.base_model import ensure_base_model

        return Path(ensure_base_model("arithmetic"))
    except Exception as exc:  # the benchmark still runs on a random model
        log(f"demo base model unavailable ({exc}); using a tiny random model")
        from harness.tiny_model import build_tiny_model

        return build_tiny_model(work / "tiny")


def make_validator(work: Path, model: Path, group_size: int, tokens: int):  # type: ignore[no-untyped-def]
    from ledger.log import Ledger
    from node.config import ValidatorConfig, load
    from node.validator.core import Validator
    from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
    from node.validator.state import StateStore
    from rewards.tasks.base import generate
    from rollout.oracle import TransformersOracle
    from verify.keys import SigningKey
    from verify.spotcheck import FLOAT32_TOLERANCE

    cfg = load(ValidatorConfig, None, {
        "assignment.group_size": group_size, "assignment.max_tokens": tokens,
        "audit.rate_override": 0.0, "audit.queue": 64, "limits.requests_per_s": 1e6,
        "limits.burst": 1_000_000, "node.checkpoint_every": 1_000_000,
    })
    key = SigningKey.from_seed(b"\x01" * 32)
    codec = HFTextCodec(model)
    v = Validator(cfg, key, Ledger.open(work / "ledger.sqlite", signing_key=key, origin="bench"),
                  StateStore(work / "state.sqlite"), codec, TransformersOracle({0: model}),
                  generate("arithmetic", "train", 10_000), PolicyVersions(model_dir_digest(model)),
                  FLOAT32_TOLERANCE)
    return v, codec


def synthetic_groups(v, n: int, tokens: int, vocab: int, clients: int):  # type: ignore[no-untyped-def]
    """n signed groups of random in-vocabulary tokens, spread over ``clients`` keys."""
    from rollout.worker import header_fields, open_assignment
    from verify.envelope import build_envelope
    from verify.keys import SigningKey
    from verify.types import GroupSubmission, canonical_bytes

    rng = np.random.default_rng(0)
    keys = [SigningKey.from_seed(bytes([10 + i]) * 32) for i in range(clients)]
    for k in keys:
        v.register(k.public.raw, "bench")
    out: list[list[bytes]] = [[] for _ in keys]
    for i in range(n):
        k = keys[i % clients]
        a = open_assignment(v.assign(k.public.raw), v.key.public, k.public)
        envs = [build_envelope(k, header_fields(a, g, 0), rng.integers(4, vocab, tokens),
                               -rng.exponential(1.0, tokens)) for g in range(a.group_size)]
        out[i % clients].append(canonical_bytes(GroupSubmission(a.assignment_id, envs)))
    return out


def admission(v, per_client: list[list[bytes]]) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    import httpx

    from node.validator.server import BackgroundServer
    from node.validator.service import create_app

    latencies: list[float] = []
    lock = threading.Lock()
    with BackgroundServer(create_app(v)) as url:

        def worker(bodies: list[bytes]) -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                for body in bodies:
                    start = time.perf_counter()
                    r = client.post("/v1/submit", content=body)
                    took = time.perf_counter() - start
                    assert r.status_code == 200, r.text
                    with lock:
                        latencies.append(took)

        threads = [threading.Thread(target=worker, args=(b,)) for b in per_client]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    return sum(len(b) for b in per_client) / elapsed, latencies


def spotcheck_cost(model: Path, codec, group_size: int, rounds: int = 8) -> dict:  # type: ignore[no-untyped-def]
    from node.validator.spot import spot_check_group
    from rewards.tasks.base import generate
    from rollout.backends import GenerationRequest, TransformersBackend
    from rollout.oracle import TransformersOracle
    from verify.envelope import build_envelope, verify_envelope
    from verify.keys import SigningKey
    from verify.spotcheck import FLOAT32_TOLERANCE
    from verify.types import SamplingParams

    backend = TransformersBackend(model)
    oracle = TransformersOracle({0: model})
    oracle.model(0)  # load before timing, as a running validator already has
    key = SigningKey.from_seed(b"\x02" * 32)
    gen_s = check_s = 0.0
    tokens = 0
    for i, problem in enumerate(generate("arithmetic", "train", rounds, seed=9)):
        prompt = codec.encode(problem.prompt)
        nonce = bytes([i]) * 32
        req = GenerationRequest(tuple(prompt), group_size, 1.0, 0, 1.0, 32, key.public.raw, nonce, i,
                                (codec.eos_token_id,))
        start = time.perf_counter()
        comps = backend.generate(req)
        gen_s += time.perf_counter() - start
        rollouts = []
        for c in comps:
            fields = dict(policy_version=0, manifest_digest=b"\0" * 32, task_id="arithmetic",
                          prompt_id=problem.id, prompt_digest=b"\0" * 32, assignment_id=b"\0" * 16,
                          nonce=nonce, sampling=SamplingParams(1.0, 1.0, 0, 32, i), group_index=c.group_index,
                          group_size=group_size, created_at_ms=0)
            rollouts.append(verify_envelope(build_envelope(key, fields, c.token_ids, c.logprobs)))
            tokens += len(c.token_ids)
        start = time.perf_counter()
        results = spot_check_group(rollouts, prompt, oracle, b"\x03" * 32, 2, FLOAT32_TOLERANCE)
        check_s += time.perf_counter() - start
        assert not any(isinstance(r, Exception) for r in results)
    return {"generation_s": round(gen_s, 3), "spotcheck_s": round(check_s, 3),
            "spotcheck_cost_ratio": round(check_s / gen_s, 3), "rollout_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    from verify.envelope import verify_envelope
    from verify.types import GroupSubmission, decode

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_dir(work)
        v, codec = make_validator(work, model, args.group_size, args.tokens)
        log(f"signing {args.groups} groups of {args.group_size} x {args.tokens} tokens")
        per_client = synthetic_groups(v, args.groups, args.tokens, codec.vocab_size, args.clients)
        sample = decode(GroupSubmission, per_client[0][0], max_bytes=1 << 26).envelopes[0]
        env_rate = best_rate(lambda: verify_envelope(sample), 300)
        log("admitting over loopback HTTP")
        groups_per_s, latencies = admission(v, per_client)
        log("measuring spot-check cost against generation")
        cost = spotcheck_cost(model, codec, args.group_size)
        v.ledger.close()
        v.state.close()
    envelopes_per_s = groups_per_s * args.group_size
    emit({
        "bench": "validator",
        "groups": args.groups, "group_size": args.group_size, "tokens_per_rollout": args.tokens,
        "clients": args.clients,
        "admitted_groups_per_s": round(groups_per_s, 1),
        "admitted_envelopes_per_s": round(envelopes_per_s, 1),
        "envelope_verifies_per_s": round(env_rate, 1),
        "admission_ratio": round(envelopes_per_s / env_rate, 3),
        "admission_ratio_target": 0.5,
        "admission_p50_ms": round(1000 * float(np.percentile(latencies, 50)), 2),
        "admission_p99_ms": round(1000 * float(np.percentile(latencies, 99)), 2),
        **cost,
        "spotcheck_cost_target": 0.35,
        "model": str(model),
    })


if __name__ == "__main__":
    main()
