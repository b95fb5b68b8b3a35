"""A tiny random Llama with the character tokenizer, for tests, fuzzing and benchmarks.

Random weights (seeded) with a scaled-up output layer so next-token
distributions are peaked like a trained model's rather than flat.
"""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_model(path: Path, seed: int = 0, layers: int = 2, scale: float = 3.0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.loading import MODEL_BUILD_LOCK
    from trainer.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    with MODEL_BUILD_LOCK:
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
