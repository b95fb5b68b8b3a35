"""Prompt text to token ids, the same way on every node.

A tokenizer with a chat template (an instruct model's) gets the prompt as one
user message with the assistant's turn opened, rendered by its own template
and tokenised without further special tokens; one without a template (the
demo's character tokenizer) encodes the text as it is. Validators,
contributors and evals all encode through :func:`encode_prompt`, so the ids a
validator recomputes under are the ids a contributor generated from.
"""

from __future__ import annotations

from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of prompt ``text`` for ``tokenizer`` (a ``transformers`` tokenizer)."""
    if has_chat_template(tokenizer):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])
