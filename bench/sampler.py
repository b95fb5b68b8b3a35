"""The verifiable samplers' cost per token against the model's own forward pass, one core.

For each sampler (``icdf-v1``, the default, and ``gumbel-v1``, the baseline) and vocabulary
(101, 49,152, 151,936), per token:
  contributor_ms   keyed randomness plus the draw, from processed logprobs
  replay_ms        the validator's replay, from the logits its forward pass produced (the
                   processed logprobs, which the logprob comparison computes anyway, passed in)
against two denominators per token, measured in the same run, of the demo policy
(vocabulary 101) and of a model of SmolLM2-135M's shape (Llama, 30 layers, hidden 576,
vocabulary 49,152; random weights cost what trained ones do):
  forward          the teacher-forced forward pass (``--batch`` x ``--seq`` tokens in one
                   call, logits for all): what a validator's recomputation pays per token
  decode           the KV-cached decode path (``--batch`` rows, one token a step after a
                   ``--seq``-token prompt): what a contributor's generation pays per token
Prints one JSON object on its last line. ``ratios[sampler][side][vocab][denominator]`` is
the sampler's cost over each model's pass per token, for vocabularies ``101`` (the demo
policy) and ``49152`` (the 135M shape); ``headline`` collects ``icdf-v1``'s four, and
``target_met`` says whether icdf-v1 stays within 0.05 of the 135M shape's forward pass
(the full forward is the smaller denominator, so the stricter one).

    python bench/sampler.py [--tokens 64] [--batch 8] [--seq 256] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._util import emit, pin_one_core  # noqa: E402
from verify.logprobs import process_logits  # noqa: E402
from verify.samplers import SAMPLERS  # noqa: E402

VOCABS = (101, 49_152, 151_936)
KEY, NONCE = bytes(range(32)), b"\x07" * 32
SMOLLM2_SHAPE: dict[str, Any] = dict(
    vocab_size=49_152,
    hidden_size=576,
    intermediate_size=1_536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2_048,
    tie_word_embeddings=True,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def best_ms(fn: Callable[[], object], per: int, rounds: int) -> float:
    """Milliseconds per item: the best of ``rounds`` runs of ``fn`` over ``per`` items."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best / per


def sampler_costs(tokens: int, rounds: int) -> dict:
    out: dict[str, dict[str, dict[str, float]]] = {}
    gen = torch.Generator().manual_seed(0)
    for vocab in VOCABS:
        logits = torch.randn(tokens, vocab, generator=gen) * 3.0  # (T, V)
        processed = process_logits(logits, 1.0, 0, 1.0)
        for name, sampler in SAMPLERS.items():
            specs = [(KEY, NONCE, 1, 0, range(tokens))]

            def contribute(sampler=sampler, specs=specs, vocab=vocab, processed=processed):  # type: ignore[no-untyped-def]
                return sampler.draw(processed, sampler.randomness(specs, vocab))

            drawn = contribute()
            randomness = sampler.randomness(specs, vocab)

            def replay(
                sampler=sampler,
                drawn=drawn,
                logits=logits,
                randomness=randomness,  # type: ignore[no-untyped-def]
                processed=processed,
            ):
                return sampler.replay(
                    drawn, logits, 1.0, 0, 1.0, randomness, slack=1e-4, processed=processed
                )

            out.setdefault(name, {})[str(vocab)] = {
                "contributor_ms": round(best_ms(contribute, tokens, rounds), 5),
                "replay_ms": round(best_ms(replay, tokens, rounds), 5),
            }
            log(f"{name} V={vocab}: {out[name][str(vocab)]}")
    return out


def forward_ms(model: torch.nn.Module, batch: int, seq: int, vocab: int, rounds: int) -> float:
    """Teacher-forced forward pass per token (batch x seq tokens at once, logits for all)."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(input_ids=ids[:1, :8])  # warm-up
        return best_ms(lambda: model(input_ids=ids), batch * seq, rounds)


def decode_ms(model: torch.nn.Module, batch: int, seq: int, vocab: int, rounds: int) -> float:
    """KV-cached decode per token: ``batch`` rows, one token a step for ``steps`` steps after a
    ``seq``-token prompt (prefilled before timing, again each round)."""
    from rollout.backends import cache_kwarg

    steps, kw = 16, cache_kwarg(model)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    nxt = torch.randint(0, vocab, (batch, steps), generator=gen)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first is a warm-up
            cache = getattr(model(input_ids=ids, use_cache=True), kw)
            start = time.perf_counter()
            for s in range(steps):
                out = model(input_ids=nxt[:, s : s + 1], use_cache=True, **{kw: cache})
                cache = getattr(out, kw)
            best = min(best, time.perf_counter() - start)
    return 1e3 * best / (batch * steps)


def demo_model() -> Any:
    from transformers import AutoModelForCausalLM

    try:
        from trainer.base_model import ensure_base_model

        path = Path(ensure_base_model("arithmetic"))
    except Exception as exc:  # the benchmark still runs on a tiny random model
        import tempfile

        from harness.tiny_model import build_tiny_model

        log(f"demo base model unavailable ({exc}); using a tiny random model")
        path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def smollm2_shaped() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sampler measurement")
    parser.add_argument("--batch", type=int, default=8, help="forward pass batch")
    parser.add_argument("--seq", type=int, default=256, help="forward pass sequence length")
    parser.add_argument("--rounds", type=int, default=5, help="best of this many runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.batch, args.seq, args.rounds = 8, 1, 16, 2
    pin_one_core()
    torch.set_num_threads(1)
    costs = sampler_costs(args.tokens, args.rounds)
    demo, shaped = demo_model(), smollm2_shaped()
    rounds_135m = max(1, args.rounds // 2)
    passes = {
        "101": {
            "forward": forward_ms(demo, args.batch, args.seq, demo.config.vocab_size, args.rounds),
            "decode": decode_ms(demo, args.batch, args.seq, demo.config.vocab_size, args.rounds),
        },
        "49152": {
            "forward": forward_ms(shaped, args.batch, args.seq, 49_152, rounds_135m),
            "decode": decode_ms(shaped, args.batch, args.seq, 49_152, rounds_135m),
        },
    }
    log(f"per token, ms: {passes}")
    ratios = {
        name: {
            side: {
                vocab: {kind: round(c[vocab][side] / ms, 4) for kind, ms in per.items()}
                for vocab, per in passes.items()
            }
            for side in ("contributor_ms", "replay_ms")
        }
        for name, c in costs.items()
    }
    icdf = ratios["icdf-v1"]
    emit(
        {
            "bench": "sampler",
            "tokens": args.tokens,
            "forward_ms_per_token": {
                "demo_policy": round(passes["101"]["forward"], 5),
                "smollm2_135m_shape": round(passes["49152"]["forward"], 5),
            },
            "decode_ms_per_token": {
                "demo_policy": round(passes["101"]["decode"], 5),
                "smollm2_135m_shape": round(passes["49152"]["decode"], 5),
            },
            "samplers": costs,
            "ratios": ratios,
            "headline": {
                f"icdf-v1 {side} / {model} {kind}": icdf[side][vocab][kind]
                for side in ("contributor_ms", "replay_ms")
                for vocab, model in (("101", "demo policy"), ("49152", "SmolLM2-135M shape"))
                for kind in ("forward", "decode")
            },
            "baseline": "each model's own pass per token, measured in the same run: the "
            "teacher-forced forward (forward) and the KV-cached decode path (decode)",
            "icdf_vs_gumbel_contributor_49152": round(
                costs["gumbel-v1"]["49152"]["contributor_ms"]
                / costs["icdf-v1"]["49152"]["contributor_ms"],
                2,
            ),
            "target_met": max(icdf[s]["49152"]["forward"] for s in icdf) <= 0.05,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
