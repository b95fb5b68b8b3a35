"""Seeded synthetic tasks with disjoint train/held-out splits, a JSONL loader, prompt refs.

from rewards.tasks import generate, load_jsonl, ProblemIndex, ref
problems = generate("arithmetic", "heldout", n=200, seed=0)
index = ProblemIndex(problems)
index.resolve(ref(problems[0]))  # -> the Problem, or PromptMismatchError
"""

from rewards.tasks.base import (
    SPLITS,
    ProblemIndex,
    PromptMismatchError,
    PromptRef,
    Split,
    TaskGenerator,
    generate,
    get_task,
    ref,
    register_task,
    split_of,
)
from rewards.tasks.jsonl import load_jsonl

__all__ = [
    "SPLITS",
    "ProblemIndex",
    "PromptMismatchError",
    "PromptRef",
    "Split",
    "TaskGenerator",
    "generate",
    "get_task",
    "load_jsonl",
    "ref",
    "register_task",
    "split_of",
]
