"""vLLM against transformers generation on one GPU, on the same requests.

Builds a random Llama locally (no downloads; its output layer is scaled so
next-token distributions are peaked like a trained model's), generates the
same assignments with both backends and checks every vLLM completion the way a
validator would: replay of the verifiable sampler and logprob comparison
against a float32 teacher-forced recomputation (``rollout.oracle``). Prints
progress on stderr and one JSON object on the last line of stdout:

  vllm_tokens_per_s              all assignments in one engine call (continuous batching)
  vllm_sequential_tokens_per_s   one assignment (G completions) per call, like transformers
  transformers_tokens_per_s      TransformersBackend on the same GPU, one assignment per call
  speedup / sequential_speedup   vLLM rate / transformers rate
  replay_pass_fraction           vLLM completions whose every token passes replay_check
  replay_exact_fraction          tokens that are exactly the replayed argmax
  max_replay_gap                 largest near-tie gap replay accepted
  max_logprob_diff               max |committed - recomputed| over all vLLM tokens
  chunk_pass_fraction            32-token chunks within the calibrated tolerance
  identical_completions          fraction equal token for token to the transformers backend's
  max_logprob_diff_vs_transformers   on the shared prefix of each completion pair

Both backends draw the same CPU Gumbel noise per token, so rates include it.

    python bench/vllm_check.py [--dtype bfloat16] [--prompts 8] [--group 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from rollout.backends import GenerationRequest, TransformersBackend  # noqa: E402
from rollout.oracle import TransformersOracle  # noqa: E402
from verify.errors import SpotCheckError  # noqa: E402
from verify.samplers import sampler_named  # noqa: E402
from verify.spotcheck import (  # noqa: E402
    BFLOAT16_TOLERANCE,
    FLOAT32_TOLERANCE,
    OracleRequest,
    compare_chunk,
)

KEY = bytes(range(32))
EOS = 2


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.logit_scale)
    model.save_pretrained(path)
    return path


def make_requests(args: argparse.Namespace) -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    return [
        GenerationRequest(
            prompt_ids=tuple(int(x) for x in rng.integers(3, args.vocab, args.prompt_len)),
            group_size=args.group,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            sampler_key=KEY,
            nonce=bytes([i]) * 32,
            seed=1000 + i,
            stop_token_ids=(EOS,),
        )
        for i in range(args.prompts)
    ]


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def count_tokens(groups) -> int:
    return sum(len(c.token_ids) for group in groups for c in group)


def check_against_oracle(groups, requests, oracle, args, tolerance, eps) -> dict:
    passed = exact = tokens = chunks = chunks_ok = 0
    max_gap = max_diff = 0.0
    for request, group in zip(requests, groups, strict=True):
        params = (request.temperature, request.top_k, request.top_p)
        plen = len(request.prompt_ids)
        recomputed = oracle.logprobs_batch(
            0, [OracleRequest(request.prompt_ids + c.token_ids, plen, *params) for c in group]
        )
        for c, r in zip(group, recomputed, strict=True):
            logits = oracle.completion_logits(0, request.prompt_ids + c.token_ids, plen)
            sampler = sampler_named(request.sampler)
            randomness = sampler.randomness(
                [(KEY, request.nonce, request.seed, c.group_index, range(len(c.token_ids)))],
                args.vocab,
            )
            tokens += len(c.token_ids)
            try:
                stats = sampler.replay(c.token_ids, logits, *params, randomness, slack=eps)
            except SpotCheckError as exc:
                log(f"replay failed: {exc}")
            else:
                passed += 1
                exact += stats.exact
                max_gap = max(max_gap, stats.max_gap)
            max_diff = max(max_diff, float(np.abs(c.logprobs - r).max()))
            for start in range(0, len(c.token_ids), 32):
                chunks += 1
                try:
                    compare_chunk(
                        c.logprobs[start : start + 32],
                        r[start : start + 32],
                        tolerance,
                        start // 32,
                        position_offset=start,
                    )
                    chunks_ok += 1
                except SpotCheckError as exc:
                    log(f"chunk failed: {exc}")
    completions = sum(len(g) for g in groups)
    return {
        "replay_pass_fraction": passed / completions,
        "replay_exact_fraction": exact / tokens,
        "max_replay_gap": max_gap,
        "max_logprob_diff": max_diff,
        "chunk_pass_fraction": chunks_ok / chunks,
    }


def compare_backends(ours, theirs) -> dict:
    same = pairs = 0
    worst = 0.0
    for group_a, group_b in zip(ours, theirs, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            pairs += 1
            same += a.token_ids == b.token_ids
            n = next(
                (
                    t
                    for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False))
                    if x != y
                ),
                min(len(a.token_ids), len(b.token_ids)),
            )
            if n:
                worst = max(worst, float(np.abs(a.logprobs[:n] - b.logprobs[:n]).max()))
    return {"identical_completions": same / pairs, "max_logprob_diff_vs_transformers": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--logit-scale", type=float, default=10.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="let vLLM compile and capture CUDA graphs (slower start)",
    )
    args = parser.parse_args()
    missing = (
        "needs a CUDA GPU"
        if not torch.cuda.is_available()
        else None
        if importlib.util.find_spec("vllm")
        else "vllm is not installed"
    )
    if missing:
        log(f"vllm_check skipped: {missing}")
        emit({"bench": "vllm_check", "skipped": missing})
        return 0
    from rollout.vllm_backend import VllmBackend

    tolerance, eps = (
        (FLOAT32_TOLERANCE, 1e-4)
        if args.dtype == "float32"
        else (BFLOAT16_TOLERANCE, BFLOAT16_TOLERANCE.cdf_slack)
    )
    requests = make_requests(args)
    warm = [GenerationRequest(requests[0].prompt_ids, 2, 1.0, 0, 1.0, 4, KEY, b"w", 0)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args)
        log(f"model built in {model_dir}")
        hf = TransformersBackend(model_dir, device="cuda", dtype=args.dtype)
        hf.generate(warm[0])
        hf_groups, hf_s = timed(lambda: [hf.generate(r) for r in requests])
        log(f"transformers: {count_tokens(hf_groups)} tokens in {hf_s:.2f} s")
        hf = None  # type: ignore[assignment]  # free its GPU memory before vLLM sizes its cache
        torch.cuda.empty_cache()
        start = time.perf_counter()
        backend = VllmBackend(
            model_dir,
            dtype=args.dtype,
            enforce_eager=not args.cuda_graphs,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        startup_s = time.perf_counter() - start
        backend.generate_many(warm)
        groups, vllm_s = timed(lambda: backend.generate_many(requests))
        log(f"vllm batched: {count_tokens(groups)} tokens in {vllm_s:.2f} s")
        seq_groups, seq_s = timed(lambda: [backend.generate(r) for r in requests])
        log(f"vllm sequential: {count_tokens(seq_groups)} tokens in {seq_s:.2f} s")
        version = backend.vllm_version
        torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32
        torch.backends.cudnn.allow_tf32 = False
        oracle = TransformersOracle({0: model_dir}, device="cuda", dtype="float32")
        checks = check_against_oracle(groups, requests, oracle, args, tolerance, eps)
        backend.close()
    deterministic = [[c.token_ids for c in g] for g in groups] == [
        [c.token_ids for c in g] for g in seq_groups
    ]
    vllm_rate = count_tokens(groups) / vllm_s
    seq_rate = count_tokens(seq_groups) / seq_s
    hf_rate = count_tokens(hf_groups) / hf_s
    result = {
        "bench": "vllm_check",
        "vllm_version": version,
        "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name(),
        "prompts": args.prompts,
        "group": args.group,
        "max_tokens": args.max_tokens,
        "vocab": args.vocab,
        "tokens": count_tokens(groups),
        "vllm_startup_s": round(startup_s, 1),
        "vllm_tokens_per_s": round(vllm_rate, 1),
        "vllm_sequential_tokens_per_s": round(seq_rate, 1),
        "transformers_tokens_per_s": round(hf_rate, 1),
        "speedup": round(vllm_rate / hf_rate, 2),
        "sequential_speedup": round(seq_rate / hf_rate, 2),
        "batched_equals_sequential": deterministic,
        "replay_eps": eps,
        "tolerance_token_abs": tolerance.token_abs,
        **checks,
        **compare_backends(groups, hf_groups),
    }
    result["ok"] = (
        checks["replay_pass_fraction"] == 1.0
        and checks["chunk_pass_fraction"] == 1.0
        and deterministic
    )
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
