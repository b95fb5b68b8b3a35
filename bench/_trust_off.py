"""The trust layer switched off: prooftrain's RL loop with nothing to verify (bench only).

The reference ``bench/trust_overhead.py`` measures the trust layer against. It
runs the harness's trainer (``trainer.loop.TrainerLoop``, built from the same
scenario by ``harness.run.trainer_config``) on the same model, pipeline runner
(``trainer.pipeline.PipelineRunner``), optimizer, learning-rate schedule, loss,
batch shape and steps, and generates with the same engine
(``rollout.backends.TransformersBackend.generate_batch`` through
``generate_grouped``: one batch per step, each prompt's prefill shared by its
completions unless ``share_prefill`` is off, the keyed sampler on every
token), but with the trust layer out of the loop:

* no contributors' keys, no assignments, envelopes, Merkle commitments or
  signatures; no admission, no spot checks, no reputation, no ledger:
  :class:`PlainSource` generates each step's groups on the trainer's demand
  and hands them to the buffer as ``AcceptedSample`` structs directly, with
  the reward the validator would compute (``rewards.reward`` on the decoded
  completion, as the validator decodes it);
* no per-contributor gradients and no robust aggregation: :class:`PlainStep`
  runs one forward and backward of the whole batch under the same policy
  loss (a plain mean gradient over the batch), clips by the global norm and
  steps the same AdamW;
* no publication: the generation model holds the trainer's own parameter
  tensors (:func:`sharing_model`), so each optimizer step is what the next
  generation samples from, with nothing encoded, signed, stored or decoded.

Counters (:class:`Counts`) say what the loop did, so a test can check that
the trust layer really was off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from harness.scenario import Scenario
from node.validator.policy import HFTextCodec
from rewards import Problem, reward
from rewards.tasks import generate as generate_problems
from rollout.backends import GenerationRequest, TransformersBackend, generate_grouped
from rollout.loading import load_pretrained_lm
from trainer.config import TrainerConfig
from trainer.loop import TrainerLoop, ensure_process_group
from trainer.losses import Metrics
from trainer.pipeline import PipelineRunner
from trainer.rl import RLStep
from trainer.stages import load_stage
from verify.types import AcceptedSample, SampleBatch

PLAIN_KEY = b"\x00" * 32
"""The one "contributor" of every plain sample (its sampler key too): nothing is signed."""


@dataclass
class Counts:
    """What the trust-off loop did (a test asserts the trust layer stayed off)."""

    groups: int = 0
    samples: int = 0
    steps: int = 0
    """Optimizer steps of :class:`PlainStep`."""
    passes: int = 0
    """Forward-and-backward passes (one per step: no pass per contributor)."""


def sharing_model(model_dir: Path, stage: nn.Module) -> PreTrainedModel:
    """A ``transformers`` causal LM of ``model_dir`` whose parameters *are* ``stage``'s (the
    same ``nn.Parameter`` objects, tied ones included): the trainer's weights, handed to
    generation as they are after every optimizer step, with nothing copied."""
    model = load_pretrained_lm(model_dir, dtype=torch.float32)
    for name, p in stage.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)
    shared = {id(p) for p in stage.parameters()}
    assert all(id(p) in shared for p in model.parameters()), "a parameter is not the trainer's"
    return model.eval()


class PlainSource:
    """``trainer.buffer.SampleSource`` without a validator: when the trainer has read every
    sample, the next ``groups`` train prompts are generated with ``backend`` as one batch,
    scored, and served at policy version ``version()``."""

    def __init__(
        self,
        backend: TransformersBackend,
        codec: object,
        problems: Sequence[Problem],
        *,
        groups: int,
        group_size: int,
        max_tokens: int,
        temperature: float,
        version: Callable[[], int],
    ) -> None:
        self.backend, self.codec, self.problems = backend, codec, list(problems)
        self.groups, self.group_size = groups, group_size
        self.max_tokens, self.temperature = max_tokens, temperature
        self.version = version
        self.samples: list[AcceptedSample] = []
        self.counts = Counts()
        eos = getattr(codec, "eos_token_id", None)
        self._stops = () if eos is None else (int(eos),)

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        if cursor >= len(self.samples):
            self._produce()
        got = self.samples[cursor : cursor + limit]
        return SampleBatch(cursor=cursor, next_cursor=cursor + len(got), samples=got)

    def _request(self, i: int, prompt_ids: list[int]) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            group_size=self.group_size,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            max_tokens=self.max_tokens,
            sampler_key=PLAIN_KEY,
            nonce=blake3.blake3(f"plain/{i}".encode()).digest(),
            seed=i,
            stop_token_ids=self._stops,
        )

    def _produce(self) -> None:
        version = self.version()
        first = self.counts.groups
        picked = [self.problems[(first + k) % len(self.problems)] for k in range(self.groups)]
        prompts = [self.codec.encode(p.prompt) for p in picked]  # type: ignore[attr-defined]
        requests = [(version, self._request(first + k, ids)) for k, ids in enumerate(prompts)]
        done = generate_grouped(requests, lambda _: self.backend)
        for k, (problem, ids, got) in enumerate(zip(picked, prompts, done, strict=True)):
            assert got is not None
            completions = got[0]
            texts = self.codec.decode_batch([c.token_ids for c in completions])  # type: ignore[attr-defined]
            aid = (first + k).to_bytes(16, "little")
            for c, text in zip(completions, texts, strict=True):
                self.samples.append(
                    AcceptedSample(
                        ledger_index=len(self.samples),
                        envelope_digest=b"\x00" * 32,
                        contributor_key=PLAIN_KEY,
                        assignment_id=aid,
                        group_index=c.group_index,
                        group_size=self.group_size,
                        policy_version=version,
                        task_id=problem.task,
                        prompt_id=problem.id,
                        prompt_ids=np.asarray(ids, dtype="<u4").tobytes(),
                        token_ids=np.asarray(c.token_ids, dtype="<u4").tobytes(),
                        logprobs=np.asarray(c.logprobs, dtype="<f4").tobytes(),
                        temperature=self.temperature,
                        top_k=0,
                        top_p=1.0,
                        reward=reward(problem.task, text, problem),
                        audited=False,
                    )
                )
            self.counts.groups += 1
            self.counts.samples += len(completions)


class PlainStep(RLStep):
    """``RLStep`` without the trust layer: one forward and backward of the whole batch under
    the same policy loss (a plain mean gradient), then the same global-norm clip and
    optimizer step. No per-contributor rows, no aggregator, no weights."""

    counts: Counts

    def __call__(self, batch, weights: torch.Tensor | None = None) -> Metrics:  # noqa: ANN001
        proximal = None
        if self.proximal:
            proximal = self.runner.logprobs(
                batch.input_ids, batch.attention_mask, target_mask=batch.target_mask
            )
        rows = batch.rows(torch.arange(batch.size))
        if proximal is not None:
            rows["proximal_logprobs"] = proximal
        rows = self._pad(rows)
        self.optimizer.zero_grad(set_to_none=False)
        result = self.runner.forward_backward(rows, self._loss_fn)
        self.counts.passes += 1
        total = torch.nn.utils.clip_grad_norm_(
            self.params, self.grad_clip if self.grad_clip > 0 else float("inf")
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.counts.steps += 1
        return {**result.metrics, "train/grad_norm": float(total)}


def plain_loop(
    s: Scenario, cfg: TrainerConfig, model_dir: Path, *, share_prefill: bool = True
) -> tuple[TrainerLoop, Counts]:
    """The harness's trainer loop for scenario ``s`` (``cfg``: its ``trainer_config``) with
    the trust layer off: a :class:`PlainSource` on the trainer's own weights and a
    :class:`PlainStep`; no publish hook, no reputation weights. Set up as
    ``harness.run.run_variant`` sets up its trainer (one torch thread, seeded)."""
    torch.set_num_threads(1)
    torch.manual_seed(s.seed)
    ensure_process_group()
    stage = load_stage(model_dir, 0, 1)
    runner = PipelineRunner(stage, 0, 1, temperature=s.validator.temperature, seed=s.seed)
    backend = TransformersBackend(sharing_model(model_dir, stage), share_prefill=share_prefill)
    v = s.validator
    source = PlainSource(
        backend,
        HFTextCodec(model_dir),
        generate_problems(s.task.name, "train", s.task.train_pool, seed=s.task.seed),
        groups=cfg.batch_groups,
        group_size=v.group_size,
        max_tokens=v.max_tokens,
        temperature=v.temperature,
        version=lambda: 0,
    )
    loop = TrainerLoop(cfg, runner, source, progress=False)
    source.version = lambda: loop.version  # generation serves the trainer's current version
    base = loop.step_fn
    step = PlainStep(
        runner,
        loop.optimizer,
        base.loss,
        base.aggregator,
        grad_clip=base.grad_clip,
        importance_sampling=base.importance_sampling,
        proximal=base.proximal,
    )
    step.counts = source.counts
    loop.step_fn = step
    return loop, source.counts
