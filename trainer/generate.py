"""Batched greedy and temperature sampling for any HF causal LM, with per-token logprobs.

Prompts are encoded with the model's own tokenizer as every node encodes them
(``rollout.prompting.encode_prompt``: through its chat template when it has
one), left-padded within a
batch, and decoded with a KV cache. Position ids follow the attention mask,
so a left-padded row computes exactly what it would alone (up to kernel
rounding). Sampling draws from a ``torch.Generator`` seeded by the caller:
the same model, prompts, settings and seed give the same completions.

``Completion.logprobs[i]`` is ``log p(token_i | prefix)`` under the model at
temperature 1 — the policy's own log-probability, which a teacher-forced
pass recomputes — whatever temperature was used to pick the token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollout.backends import cache_kwarg, left_padded
from rollout.prompting import encode_prompt


@dataclass(frozen=True)
class Completion:
    prompt: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """Generated ids, the end-of-sequence token included when it was produced."""
    logprobs: tuple[float, ...]
    text: str
    """Generated text without special tokens."""
    finished: bool
    """True if generation stopped at end-of-sequence, False if at ``max_new_tokens``."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 disables."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0:
            raise ValueError("need max_new_tokens >= 1, temperature >= 0, top_k >= 0")


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an eos token")
    return int(pad)


def _out_cache(out):  # noqa: ANN001, ANN202
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    # logits: (B, V) float32 -> (B,) token ids
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.inference_mode()
def _generate_batch(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    pad_id: int,
    eos_id: int | None,
    gen: torch.Generator,
) -> list[tuple[list[int], list[float], bool]]:
    device = next(model.parameters()).device
    ids, mask, positions = (t.to(device) for t in left_padded(prompt_ids, pad_id))  # (B, T)
    cache_kw = cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, logits = _out_cache(out), out.logits[:, -1, :].float()  # (B, V)
    next_pos = positions[:, -1:] + 1  # (B, 1)
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    for _ in range(params.max_new_tokens):
        tok = _pick(logits, params, gen)  # (B,)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(logp)
        if eos_id is not None:
            done = done | (tok == eos_id)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_kw: cache},
        )
        cache, logits = _out_cache(out), out.logits[:, -1, :].float()
        next_pos = next_pos + 1
    tok_mat = torch.stack(tokens, dim=1).cpu().tolist()  # (B, N)
    logp_mat = torch.stack(logps, dim=1).cpu().tolist()
    results = []
    for row in range(len(prompt_ids)):
        seq, lps, finished = [], [], False
        for t, lp in zip(tok_mat[row], logp_mat[row], strict=True):
            seq.append(int(t))
            lps.append(float(lp))
            if eos_id is not None and t == eos_id:
                finished = True
                break
        results.append((seq, lps, finished))
    return results


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    params: SamplingParams | None = None,
    *,
    num_samples: int = 1,
    batch_size: int = 64,
    progress: Callable[[int], object] | None = None,
) -> list[Completion]:
    """``num_samples`` completions per prompt, prompt-major: ``[p0s0, p0s1, ..., p1s0, ...]``.

    ``progress`` is called after each batch with the number of completions it finished
    (``len(prompts) * num_samples`` in all), for a bar with an ETA."""
    params = params or SamplingParams()
    if num_samples < 1 or batch_size < 1:
        raise ValueError("num_samples and batch_size must be >= 1")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(params.seed)
    pad_id, eos_id = _pad_id(tokenizer), tokenizer.eos_token_id
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    jobs = [(i, encoded[i]) for i in range(len(prompts)) for _ in range(num_samples)]
    completions: list[Completion] = []
    try:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            outs = _generate_batch(model, [p for _, p in chunk], params, pad_id, eos_id, gen)
            for (i, p_ids), (seq, lps, finished) in zip(chunk, outs, strict=True):
                # A single sequence decodes to one str (the library types it str | list[str]).
                text = cast(str, tokenizer.decode(seq, skip_special_tokens=True))
                completions.append(
                    Completion(
                        prompt=prompts[i],
                        prompt_ids=tuple(p_ids),
                        token_ids=tuple(seq),
                        logprobs=tuple(lps),
                        text=text,
                        finished=finished,
                    )
                )
            if progress is not None:
                progress(len(chunk))
    finally:
        model.train(was_training)
    return completions
