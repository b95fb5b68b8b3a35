"""Build the demo base policy: a tiny Llama trained on a synthetic task until weak, not hopeless.

``build_base_model`` trains a character-level ``LlamaForCausalLM`` (about
0.54M parameters) with supervised next-token loss on the reference
completions of seeded *train*-split problems and stops as soon as its greedy
accuracy on a dev set (train split, disjoint from the training pool) reaches
``target_dev_accuracy``, so held-out pass@1 lands around that figure and RL
has headroom. It never looks at the held-out split.

Determinism: the same config and seed give the same weights on the same
software and CPU kind — fixed thread count, ``torch.manual_seed``,
``torch.use_deterministic_algorithms(True)``, seeded data order, and a
stopping rule that depends only on greedy (argmax) decoding. The digest of
the weights (:func:`weights_digest`, the base digest every policy manifest
and release card names) is printed and stored in ``build.json``. ``ensure_base_model`` caches builds under
``~/.cache/prooftrain/base-models/<task>-<seed>-<config hash>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import LlamaConfig, LlamaForCausalLM

from rewards import reward
from rewards.tasks import generate as generate_problems
from rewards.tasks import get_task
from rollout.loading import MODEL_BUILD_LOCK
from rollout.progress import progress as progress_bar
from trainer.generate import SamplingParams, generate
from trainer.tokenizer import build_char_tokenizer
from verify.manifest import base_model_digest

BUILD_INFO = "build.json"
DEV_SEED_OFFSET = 1_000_003


class BaseModelConfig(BaseModel):
    """Everything that determines the built weights (besides the seed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str = "arithmetic"
    """Synthetic task from ``rewards.tasks`` to learn."""
    hidden_size: int = Field(default=128, ge=8, le=4096)
    """Model width."""
    num_layers: int = Field(default=2, ge=1, le=64)
    """Transformer blocks."""
    num_heads: int = Field(default=4, ge=1, le=64)
    """Attention heads (also key/value heads)."""
    intermediate_size: int = Field(default=512, ge=8)
    """MLP width."""
    batch_size: int = Field(default=128, ge=1, le=8192)
    """Sequences per optimizer step."""
    learning_rate: float = Field(default=1e-3, gt=0, le=1)
    """AdamW learning rate after warm-up."""
    warmup_steps: int = Field(default=100, ge=0)
    """Linear learning-rate warm-up."""
    max_steps: int = Field(default=2000, ge=1)
    """Hard cap on optimizer steps if the dev target is never reached."""
    eval_every: int = Field(default=25, ge=1)
    """Dev-set check interval, in steps."""
    train_pool: int = Field(default=8000, ge=16)
    """Distinct train-split problems to sample batches from."""
    dev_size: int = Field(default=256, ge=16)
    """Dev problems (train split, disjoint from the pool) for the stopping rule."""
    target_dev_accuracy: float = Field(default=0.2, gt=0, lt=1)
    """Stop once greedy dev accuracy reaches this: weak, but not hopeless."""
    threads: int = Field(default=1, ge=1, le=256)
    """torch CPU threads during the build (fixed for reproducibility)."""

    def digest(self) -> str:
        body = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(body).hexdigest()[:12]


@dataclass(frozen=True)
class BuildResult:
    path: Path
    weights_digest: str
    steps: int
    dev_accuracy: float
    seconds: float
    parameters: int


def weights_digest(model_dir: str | Path) -> str:
    """Hex ``verify.manifest.base_model_digest`` of the built directory: the one base digest that
    policy manifests, the validator (``/v1/info``) and a release's card name for these weights."""
    return base_model_digest(model_dir).hex()


def default_cache_dir() -> Path:
    return (
        Path(os.environ.get("PROOFTRAIN_CACHE", Path.home() / ".cache" / "prooftrain"))
        / "base-models"
    )


def cache_path(config: BaseModelConfig, seed: int, cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{config.task}-{seed}-{config.digest()}"


def ensure_base_model(
    task: str = "arithmetic",
    seed: int = 0,
    cache_dir: str | Path | None = None,
    config: BaseModelConfig | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Path of a built base model, building it once into the cache if it is not there."""
    config = config or BaseModelConfig(task=task)
    if config.task != task:
        config = config.model_copy(update={"task": task})
    path = cache_path(config, seed, cache_dir)
    if (path / BUILD_INFO).is_file():
        return path
    build_base_model(config, seed, path, progress=progress)
    return path


def _model(config: BaseModelConfig, vocab_size: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with MODEL_BUILD_LOCK:
        return LlamaForCausalLM(cfg)


def _examples(config: BaseModelConfig, seed: int, tokenizer) -> tuple[list, list, int]:
    task = get_task(config.task)
    dev = generate_problems(config.task, "train", config.dev_size, seed + DEV_SEED_OFFSET)
    dev_prompts = {p.prompt for p in dev}
    pool = [
        p
        for p in generate_problems(config.task, "train", config.train_pool, seed)
        if p.prompt not in dev_prompts
    ]
    rows, longest = [], 0
    for p in pool:
        prompt_ids = tokenizer(p.prompt)["input_ids"]
        target = tokenizer(task.reference_completion(p), add_special_tokens=False)["input_ids"]
        target = target + [tokenizer.eos_token_id]
        longest = max(longest, len(target))
        rows.append((prompt_ids + target, len(prompt_ids)))
    return rows, dev, longest


def _batch(
    rows: list, idx: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(rows[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), width), -100, dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    for r, i in enumerate(idx):
        seq, n_prompt = rows[i]
        ids[r, : len(seq)] = torch.tensor(seq)
        labels[r, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])  # loss on the completion only
        mask[r, : len(seq)] = 1
    return ids, labels, mask


def dev_accuracy(model, tokenizer, problems, max_new_tokens: int) -> float:
    outs = generate(
        model,
        tokenizer,
        [p.prompt for p in problems],
        SamplingParams(max_new_tokens=max_new_tokens),
        batch_size=256,
    )
    return sum(reward(p.task, o.text, p) == 1.0 for p, o in zip(problems, outs, strict=True)) / len(
        problems
    )


def build_base_model(
    config: BaseModelConfig, seed: int, out: str | Path, *, progress: bool = True
) -> BuildResult:
    """Train and save the base policy to ``out`` (written to a temp dir, then renamed)."""
    out = Path(out)
    start = time.perf_counter()
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(seed)
        tokenizer = build_char_tokenizer()
        rows, dev, longest = _examples(config, seed, tokenizer)
        model = _model(config, len(tokenizer))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        opt = torch.optim.AdamW(
            model.parameters(), lr=config.learning_rate, betas=(0.9, 0.98), weight_decay=0.01
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps))
        )
        gen = torch.Generator().manual_seed(seed)
        acc, step = 0.0, 0
        bar = progress_bar(config.max_steps, f"base model {config.task}", "step", enabled=progress)
        for step in range(1, config.max_steps + 1):
            model.train()
            idx = torch.randint(len(rows), (config.batch_size,), generator=gen).tolist()
            ids, labels, mask = _batch(rows, idx, tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(1)
            if step % config.eval_every == 0:
                acc = dev_accuracy(model, tokenizer, dev, longest + 1)
                bar.set_postfix(loss=f"{loss.item():.3f}", dev_pass1=f"{acc:.3f}")
                if acc >= config.target_dev_accuracy:
                    break
        bar.close()
        result = _save(model, tokenizer, config, seed, out, step, acc, start)
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)
    return result


def _save(
    model, tokenizer, config, seed, out: Path, step: int, acc: float, start: float
) -> BuildResult:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        digest = weights_digest(tmp)
        seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        info = {
            "task": config.task,
            "seed": seed,
            "config": config.model_dump(),
            "config_digest": config.digest(),
            "steps": step,
            "dev_accuracy": acc,
            "weights_digest": digest,
            "parameters": params,
            "seconds": round(seconds, 2),
            "torch": torch.__version__,
        }
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is not secret
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out, digest, step, acc, seconds, params)
