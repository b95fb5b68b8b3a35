"""The TRL side of ``bench/trust_overhead.py``: ``GRPOTrainer`` on the same task, prompts,
batch, sampling, optimizer settings and reward function as prooftrain (see that module's
docstring), timed from the end of one optimizer step to the end of the next, with the seconds
its model's ``generate`` takes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench._phases import PhaseClock, peak_rss_mib

SEED = 0
"""Every side's seed (model init, torch, the task's prompts)."""


def pool_size(args: argparse.Namespace) -> int:
    """Distinct train prompts: enough that neither side repeats one within the run."""
    return max(1024, (args.steps + 1) * args.groups)


def _text(x: str | list[dict[str, str]]) -> str:
    """A prompt or completion as text: conversational ones are lists of messages."""
    return x if isinstance(x, str) else x[-1]["content"]


def reward_fn(
    prompts: list[Any],
    completions: list[Any],
    problem_id: list[str],
    answer: list[str],
    task: list[str],
    **_: Any,
) -> list[float | None]:
    """TRL reward function: the validator's reward (``rewards.reward``) of each completion."""
    from rewards import Problem, reward

    return [
        reward(t, _text(c), Problem(id=i, task=t, prompt=_text(p), answer=a))
        for p, c, i, a, t in zip(prompts, completions, problem_id, answer, task, strict=True)
    ]


def trl_prompt(text: str, tokenizer: Any) -> str | list[dict[str, str]]:
    """The prompt as TRL gets it: one user message when the tokenizer has a chat template,
    so TRL renders it with the template exactly as prooftrain's nodes encode it
    (``rollout.prompting.encode_prompt``), else the text itself."""
    from rollout.prompting import has_chat_template

    return [{"role": "user", "content": text}] if has_chat_template(tokenizer) else text


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards.tasks import generate as generate_problems
    from trainer.base_model import ensure_base_model

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model_dir = args.model_dir or ensure_base_model(args.task, SEED, progress=args.progress)
    problems = generate_problems(args.task, "train", pool_size(args), seed=SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_list(
        [
            {
                "prompt": trl_prompt(p.prompt, tokenizer),
                "answer": p.answer,
                "problem_id": p.id,
                "task": p.task,
            }
            for p in problems
        ]
    )
    ends: list[float] = []

    checkpointed: list[bool] = []

    clock = PhaseClock()  # TRL generates with the model's own ``generate``
    after_warmup: dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.perf_counter())
            checkpointed.append(bool(getattr(model, "is_gradient_checkpointing", False)))
            if len(ends) == args.warmup_steps:
                after_warmup.update(clock.snapshot())

    cfg = GRPOConfig(
        output_dir=str(work / "trl"),
        max_steps=args.steps + args.warmup_steps,
        seed=SEED,
        per_device_train_batch_size=args.groups * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        activation_checkpointing=False,
        scale_rewards="group",
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=args.steps + args.warmup_steps,
        dataloader_num_workers=0,
        disable_tqdm=not args.progress,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    start = time.perf_counter()
    with clock.installed([("generation", type(model), "generate")]):
        trainer.train()
    steps = len(ends) - args.warmup_steps
    generation = clock.snapshot().get("generation", 0.0) - after_warmup.get("generation", 0.0)
    return {
        "samples": steps * args.groups * args.group_size,
        "generation_s": round(generation / max(steps, 1), 4),
        "wall_s": ends[-1] - ends[args.warmup_steps - 1],
        "warmup_s": ends[args.warmup_steps - 1] - start,
        "total_wall_s": time.perf_counter() - start,
        "steps": steps,
        "peak_rss_mib": peak_rss_mib(),
        "activation_checkpointing": any(checkpointed),
    }
