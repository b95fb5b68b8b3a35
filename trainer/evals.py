"""Evaluate a policy on a task: pass@1 (greedy), pass@k (sampled), mean reward and length.

Every figure comes with a 95% confidence interval over problems:

* pass@1 (greedy) — a proportion: Wilson score interval;
* pass@k — the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` per problem
  (``n`` samples, ``c`` correct), averaged; normal interval on the per-problem
  estimates, clipped to [0, 1];
* mean reward and mean length (generated tokens, end-of-sequence included)
  of the greedy completions — normal intervals.

A completion is *correct* when its reward is exactly 1.0. Rewards are the
validator's own (:func:`rewards.reward`). ``evaluate`` takes a model
directory (anything ``AutoModelForCausalLM.from_pretrained`` loads, trainer
checkpoints included) or an already loaded ``(model, tokenizer)`` pair.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rewards import Problem, reward
from rewards.errors import TaskError, UnknownTaskError
from rewards.tasks import generate as generate_problems
from rewards.tasks import get_task
from rollout.loading import load_pretrained_lm, local_model_dir
from trainer.generate import SamplingParams, generate
from verify.keys import SigningKey
from verify.signed import seal
from verify.types import SCHEMA_VERSION, EvalMetric, EvalStatement, SignedEvalStatement

Z95 = 1.959963984540054
DEFAULT_MAX_NEW_TOKENS = 256


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return (low, high)


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high) with a normal interval; a single value has zero width."""
    n = len(values)
    if n == 0:
        return (float("nan"), float("nan"), float("nan"))
    mean = sum(values) / n
    if n == 1:
        return (mean, mean, mean)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return (mean, mean - half, mean + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError("need 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    ci_low: float
    ci_high: float
    n: int


@dataclass(frozen=True)
class EvalReport:
    model: str
    task: str
    split: str
    problems: int
    metrics: tuple[Metric, ...]
    settings: dict = field(default_factory=dict)

    def metric(self, name: str) -> Metric:
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(name)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "task": self.task,
            "split": self.split,
            "problems": self.problems,
            "metrics": {
                m.name: {k: v for k, v in asdict(m).items() if k != "name"} for m in self.metrics
            },
            "settings": self.settings,
        }

    def to_table(self) -> str:
        head = f"{self.task} / {self.split} / {self.problems} problems / {self.model}"
        rows = [("metric", "value", "95% CI", "n")]
        for m in self.metrics:
            rows.append((m.name, f"{m.value:.4f}", f"[{m.ci_low:.4f}, {m.ci_high:.4f}]", str(m.n)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def load_policy(
    model_dir: str | Path, device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a local directory (never the network)."""
    path = local_model_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = load_pretrained_lm(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # functools.wraps on PreTrainedModel.to hides the bound signature (mypy sees self first).
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


def default_max_new_tokens(problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase) -> int:
    """Room for the longest reference completion plus slack, for synthetic tasks."""
    try:
        gens = {p.task: get_task(p.task) for p in problems}
    except UnknownTaskError:
        return DEFAULT_MAX_NEW_TOKENS
    fixed = [getattr(g, "default_max_tokens", None) for g in gens.values()]
    if any(fixed):
        return max(f for f in fixed if f)
    longest = max(
        len(tokenizer(gens[p.task].reference_completion(p), add_special_tokens=False)["input_ids"])
        for p in problems
    )
    return longest + 4


def evaluate(
    model: str | Path | tuple[PreTrainedModel, PreTrainedTokenizerBase],
    task: str = "arithmetic",
    split: str = "heldout",
    *,
    n: int = 200,
    k: int = 8,
    samples: int | None = None,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    problems: Sequence[Problem] | None = None,
    device: str | None = None,
    progress: Callable[[int], object] | None = None,
) -> EvalReport:
    """Evaluate on ``problems`` or on ``n`` generated ``task``/``split`` problems (``seed``).

    ``progress`` is called with the number of completions each generated batch finished:
    ``eval_completions(len(problems), k, samples)`` in all."""
    if isinstance(model, tuple):
        policy, tokenizer = model
        name = getattr(policy.config, "_name_or_path", "") or type(policy).__name__
    else:
        policy, tokenizer = load_policy(model, device)
        name = str(model)
    if problems is None:
        problems = generate_problems(task, split, n, seed)
    if not problems:
        raise TaskError("no problems to evaluate")
    samples = samples if samples is not None else k
    if k < 1 or samples < k:
        raise TaskError("need k >= 1 and samples >= k")
    max_new = max_new_tokens or default_max_new_tokens(problems, tokenizer)
    prompts = [p.prompt for p in problems]
    greedy = generate(
        policy,
        tokenizer,
        prompts,
        SamplingParams(max_new_tokens=max_new),
        batch_size=batch_size,
        progress=progress,
    )
    rewards = [reward(p.task, o.text, p) for p, o in zip(problems, greedy, strict=True)]
    correct = sum(r == 1.0 for r in rewards)
    metrics = [
        Metric(
            "pass@1 (greedy)",
            correct / len(problems),
            *wilson_interval(correct, len(problems)),
            len(problems),
        )
    ]
    if _samples_drawn(k, samples):
        sampled = generate(
            policy,
            tokenizer,
            prompts,
            SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed),
            num_samples=samples,
            batch_size=batch_size,
            progress=progress,
        )
        per_problem = []
        for i, p in enumerate(problems):
            outs = sampled[i * samples : (i + 1) * samples]
            c = sum(reward(p.task, o.text, p) == 1.0 for o in outs)
            per_problem.append(pass_at_k(samples, c, k))
        mean, lo, hi = mean_interval(per_problem)
        metrics.append(
            Metric(
                f"pass@{k} (T={temperature:g}, {samples} samples)",
                mean,
                max(0.0, lo),
                min(1.0, hi),
                len(problems),
            )
        )
    mean, lo, hi = mean_interval(rewards)  # rewards lie in [0, 1]: so does the interval
    metrics.append(Metric("mean reward (greedy)", mean, max(0.0, lo), min(1.0, hi), len(problems)))
    lengths = [float(len(o.token_ids)) for o in greedy]
    metrics.append(Metric("mean length (greedy, tokens)", *mean_interval(lengths), len(problems)))
    settings = {
        "k": k,
        "samples": samples,
        "temperature": temperature,
        "seed": seed,
        "max_new_tokens": max_new,
    }
    return EvalReport(name, problems[0].task, split, len(problems), tuple(metrics), settings)


def eval_completions(problems: int, k: int, samples: int | None = None) -> int:
    """How many completions ``evaluate`` generates for ``problems`` problems: one greedy each,
    plus ``samples`` (default ``k``) sampled each when pass@k is drawn."""
    samples = samples if samples is not None else k
    return problems + (problems * samples if _samples_drawn(k, samples) else 0)


def _samples_drawn(k: int, samples: int) -> bool:
    return k > 1 or samples > 1


def evaluate_heldout(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: str, n: int, seed: int
) -> EvalReport:
    """The held-out greedy pass@1 report a trainer records for a version: ``n`` problems of
    ``task`` drawn with ``seed``, one greedy sample each."""
    return evaluate((model, tokenizer), task, "heldout", n=n, k=1, samples=1, seed=seed)


def report_json(report: EvalReport) -> str:
    return json.dumps(report.to_json(), indent=2, sort_keys=True)


def eval_statement(
    report: EvalReport,
    *,
    version: int,
    manifest_digest: bytes,
    task: str,
    split: str,
    seed: int,
    key: SigningKey,
    created_at_ms: int,
) -> SignedEvalStatement:
    """Sign ``report`` as the evaluation of policy ``version`` (``manifest_digest``: empty for 0).

    The trainer calls this at every published version and hands the result to
    the validator (``Validator.record_eval`` / ``ValidatorClient.record_eval``).
    """
    metrics = [
        EvalMetric(m.name[:256], float(m.value), float(m.ci_low), float(m.ci_high))
        for m in report.metrics
    ]
    stmt = EvalStatement(
        SCHEMA_VERSION,
        version,
        bytes(manifest_digest),
        task,
        split,
        report.problems,
        seed,
        metrics,
        key.public.raw,
        created_at_ms,
    )
    sealed = seal(key, stmt)
    return sealed


def report_from_statement(stmt: EvalStatement) -> EvalReport:
    """The :class:`EvalReport` an :class:`EvalStatement` states (``n`` = its problem count)."""
    metrics = tuple(Metric(m.name, m.value, m.lo, m.hi, stmt.problems) for m in stmt.metrics)
    settings = {"seed": stmt.seed, "version": stmt.version}
    return EvalReport(
        f"policy v{stmt.version}", stmt.task_id, stmt.split, stmt.problems, metrics, settings
    )
