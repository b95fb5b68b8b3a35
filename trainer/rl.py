"""One off-policy RL step on one pipeline stage (DESIGN.md, data flow step 8).

Per step, on every stage (every rank makes the same calls in the same order):

1. for ppo-decoupled, the proximal logprobs (policy before this step) are
   computed without gradient;
2. one gradient row per contributor c, in ``(n, d)``: when the stage's
   parameters allow it (``trainer.groupgrad``), one ``forward_backward`` of
   the whole batch, rows ordered by contributor, with loss ``sum_c loss_c``
   and every row's parameter contributions summed into its contributor's row;
   otherwise, for each c, zero the grads, ``forward_backward`` on c's rows
   only and flatten this stage's grads into row c. The two give the same rows
   (up to float rounding): rows never interact, and loss_c sees only c's rows
   either way;
3. aggregate the n rows with the configured ``Aggregator`` (each stage
   aggregates its own shard, from that shard's norms and distances alone;
   weights e.g. from reputation) and write the result back into ``.grad``.
   So a norm-based aggregator such as centered clipping clips each of the S
   shards on its own: where it clips, its update with S stages differs from
   S = 1's, and it bounds a contributor's influence on every shard rather
   than on the whole vector. With the one-pass plan and an aggregator that
   works from the rows' Gram matrix (``verify.aggregate.GramAggregator``, the
   default centered clipping among them) the rows are never formed: the pass
   keeps each module's inputs and output gradients, ``GroupGradients.gram``
   forms ``K = R R^T`` (n, n) a parameter block at a time, the aggregator
   turns K into coefficients alpha, and ``GroupGradients.combine`` writes
   ``alpha @ R`` into ``.grad`` (from the rows ``gram`` kept within
   ``GroupGradients.keep_bytes``, else in one weighted pass): memory bounded by
   that budget rather than ``n x d``, the same result up to rounding. With
   ``gram_sketch`` w > 0, K is instead estimated from a fresh random w x w
   sketch of each weight matrix's per-contributor gradient
   (``GroupGradients.gram_sketch``, unbiased, never forming the rows) and the
   combine is the weighted pass: the aggregator sees the sketched vectors' exact
   geometry, the update is ``alpha @ R`` exactly;
4. clip by the global norm (squared norms summed over stages) and step.

Invariants: a contributor's rows reach the optimizer only through its one
gradient row, so a robust aggregator bounds what any one contributor does to
the update; a non-finite contributor gradient is dropped (and counted) rather
than poisoning the aggregate.

Every step also reports, per contributor key, the rows it signed
(``damage/samples/<fingerprint>``), its share of the aggregation weight
(``damage/weight/<fingerprint>``: its coefficient in the aggregate over their
sum) and of the update (``damage/update/<fingerprint>``: coefficient times
gradient norm, over their sum), so a harness can account for what each
identity put into training.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.batch import TrainBatch
from trainer.groupgrad import GRAM_KEEP_BYTES, GroupGradients
from trainer.losses import Metrics, PolicyLoss
from trainer.pipeline import PipelineRunner
from verify.aggregate import Aggregator, GramAggregator
from verify.aggregate_blocks import COLUMN_BLOCK, all_finite
from verify.errors import ConfigError

LrSchedule = Callable[[float], float]
"""Decay shape: training progress in [0, 1] after warm-up -> multiplier in [0, 1]."""

LR_SCHEDULES: dict[str, LrSchedule] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def lr_multiplier(
    name: str, step: int, total: int, *, warmup: int = 0, min_ratio: float = 0.0
) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based) of ``total``.

    Linear warm-up from ``1 / (warmup + 1)`` to 1 over the first ``warmup`` steps, then
    ``min_ratio + (1 - min_ratio) * shape(progress)``; steps past ``total`` keep the final
    value. Pure in ``step``, so a resumed run follows the same schedule.
    """
    if name not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr schedule {name!r}; known: {sorted(LR_SCHEDULES)}")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * LR_SCHEDULES[name](progress)


def _params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _tied_copies(module: torch.nn.Module) -> set[int]:
    """Ids of a stage's tied copies (``Stage.tied_copies``: the last stage's ``lm_head`` when
    S > 1). Stage 0 holds the same tensor, so norms leave the copy out (else S > 1 counts it
    twice and clips differently from S = 1)."""
    names = getattr(module, "tied_copies", {})
    return {id(p) for n, p in module.named_parameters() if n in names}


def _norm_spans(params: list[torch.nn.Parameter], skip: set[int]) -> list[tuple[int, int]]:
    """Column spans of ``flat_grad(params)`` outside the parameters in ``skip``."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for p in params:
        end = offset + p.numel()
        if id(p) not in skip:
            if spans and spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((offset, end))
        offset = end
    return spans


def _squared_norms(rows: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """Each row's squared l2 norm over the column ``spans`` (a tied copy left out), (n,)
    float64: float32 over blocks of columns, summed in float64 (one float32 reduction over
    the 10^8 entries of a 135M-parameter row is off by about 1%)."""
    out = torch.zeros(rows.shape[0], dtype=torch.float64)
    for a, b in spans:
        for lo in range(a, b, COLUMN_BLOCK):
            block = rows[:, lo : min(b, lo + COLUMN_BLOCK)]
            out += torch.linalg.vector_norm(block, dim=1).double() ** 2
    return out


def _squared_norm(t: Tensor) -> float:
    """``t``'s squared l2 norm as in :func:`_squared_norms`: float32 norms of blocks of
    ``COLUMN_BLOCK`` entries, squared and summed in float64 (casting a large tensor to
    float64 first costs several times as long)."""
    flat = t.detach().reshape(-1)
    whole = flat.numel() // COLUMN_BLOCK * COLUMN_BLOCK
    total = 0.0
    if whole:
        blocks = flat[:whole].view(-1, COLUMN_BLOCK)
        total += float((torch.linalg.vector_norm(blocks, dim=1).double() ** 2).sum())
    if whole < flat.numel():
        total += float(torch.linalg.vector_norm(flat[whole:]).double()) ** 2
    return total


def flat_grad(params: list[torch.nn.Parameter], out: Tensor | None = None) -> Tensor:
    """This stage's gradient as one float32 vector (missing grads count as zero), written
    into ``out`` when given."""
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
        for p in params
    ]
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def write_grad(params: list[torch.nn.Parameter], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def _secret_generator() -> torch.Generator:
    """A generator seeded from the operating system: nothing a contributor sees predicts it."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def _all_stages(flags: list[bool]) -> list[bool]:
    """Each flag ANDed over every pipeline stage (one all-reduce; local when S = 1)."""
    local = torch.tensor([float(f) for f in flags])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MIN)
    return [bool(v >= 1) for v in local]


def sample_counts(batch: TrainBatch) -> Metrics:
    """``damage/samples/<fingerprint>``: how many of the batch's rows each contributor key
    signed (the fingerprint is the key's first 8 hex digits, as in ``aggregate/grad_norm/``)."""
    counts = torch.bincount(batch.contributor, minlength=len(batch.contributors)).tolist()
    return {
        f"damage/samples/{key.hex()[:8]}": float(n)
        for key, n in zip(batch.contributors, counts, strict=True)
        if n
    }


def weight_shares(alpha: Tensor, labels: list[str], norms: Tensor) -> Metrics:
    """Each contributor's share of the aggregation: ``damage/weight/<fingerprint>``, its
    coefficient over the sum of the coefficients, and ``damage/update/<fingerprint>``, its
    coefficient times its gradient's norm (``norms``, this stage's) over the sum of those (the
    part of the update's length it can account for). Zero for all when a sum is 0. Metrics
    only: the step's math does not read them."""
    a = alpha.detach().to(torch.float64).clamp(min=0.0)
    mass = a * norms.detach().to(torch.float64).clamp(min=0.0)
    total, total_mass = float(a.sum()), float(mass.sum())
    out: Metrics = {}
    for i, label in enumerate(labels):
        out[f"damage/weight/{label}"] = float(a[i]) / total if total > 0 else 0.0
        out[f"damage/update/{label}"] = float(mass[i]) / total_mass if total_mass > 0 else 0.0
    return out


class RLStep:
    """Per-contributor gradients, robust aggregation, clip, optimizer step.

    ``importance_sampling=False`` scores every token as if it were on-policy
    (behaviour logprobs replaced by the detached current ones: ratio 1); a
    baseline for benchmarks, never the default.
    """

    def __init__(
        self,
        runner: PipelineRunner,
        optimizer: torch.optim.Optimizer,
        loss: PolicyLoss,
        aggregator: Aggregator,
        *,
        grad_clip: float = 1.0,
        importance_sampling: bool = True,
        proximal: bool = False,
        gram_sketch: int = 0,
        keep_bytes: int = GRAM_KEEP_BYTES,
    ) -> None:
        self.runner = runner
        self.optimizer = optimizer
        self.loss = loss
        self.aggregator = aggregator
        self.grad_clip = grad_clip
        self.importance_sampling = importance_sampling
        self.proximal = proximal
        self.params = _params(runner.stage)
        copies = _tied_copies(runner.stage)
        self._counted = [p for p in self.params if id(p) not in copies]
        """The parameters whose gradients count towards norms: all but a tied copy."""
        self._spans = _norm_spans(self.params, copies)
        self.grouped = (
            GroupGradients.plan(runner.stage, self.params)
            if runner.num_microbatches == 1 and not runner.ties_across_stages
            else None
        )
        """One pass for every contributor's gradient, or None: one pass per contributor."""
        if self.grouped is not None:
            self.grouped.keep_bytes = keep_bytes
        self.via_gram = True
        """With a one-pass plan and a ``GramAggregator``, aggregate from the contributors'
        Gram matrix (``GroupGradients.gram``) and hold no (n, d) rows; False: hold them."""
        self._rows: Tensor | None = None  # the (n, d) rows, kept between steps
        self.gram_sketch = gram_sketch
        """0: the exact Gram matrix. w > 0: its unbiased estimate from a fresh w x w sketch of
        every weight matrix's per-contributor gradient (``GroupGradients.gram_sketch``),
        drawn from the operating system's randomness after the batch is fixed. The
        per-contributor norms in the step's metrics (``aggregate/grad_norm/``, the update
        shares) are then the sketch's; the global clip uses the aggregate's exact norm."""

    @property
    def gram(self) -> bool:
        """Whether steps aggregate from the Gram matrix (see ``via_gram``)."""
        return (
            self.via_gram
            and self.grouped is not None
            and isinstance(self.aggregator, GramAggregator)
        )

    def _loss_fn(self, logprobs: Tensor, mb: Mapping[str, Any]) -> tuple[Tensor, Metrics]:
        mask = mb["target_mask"]
        behaviour = mb["behaviour_logprobs"] if self.importance_sampling else logprobs.detach()
        return self.loss(
            logprobs,
            behaviour,
            mb["advantages"],
            mask,
            proximal_logprobs=mb.get("proximal_logprobs"),
        )

    def _pad(self, rows: dict[str, Tensor]) -> dict[str, Tensor]:
        """Pad with masked-out rows to a multiple of the runner's micro-batch count."""
        m = self.runner.num_microbatches
        extra = (-rows["input_ids"].shape[0]) % m
        if not extra:
            return rows
        out = {}
        for key, t in rows.items():
            filler = torch.zeros((extra, *t.shape[1:]), dtype=t.dtype)
            if key == "attention_mask":
                filler[:, 0] = 1  # one real position keeps attention well defined
            out[key] = torch.cat([t, filler])
        return out

    def __call__(self, batch: TrainBatch, weights: Tensor | None = None) -> Metrics:
        """One step on ``batch``; ``weights`` (n_contributors,) or None for uniform."""
        proximal = None
        if self.proximal:
            proximal = self.runner.logprobs(
                batch.input_ids, batch.attention_mask, target_mask=batch.target_mask
            )
        if self.gram:
            names, metric_rows, dropped, metrics = self._gram_pass(batch, proximal, weights)
            metrics["aggregate/dropped_nonfinite"] = float(dropped)
            for key in metric_rows[0] if metric_rows else {}:
                metrics[key] = sum(r.get(key, 0.0) for r in metric_rows) / len(metric_rows)
            metrics.update(sample_counts(batch))
            return metrics
        rows_out = self._rows_buffer(len(batch.contributors))
        if self.grouped is not None:
            names, metric_rows, dropped = self._one_pass(batch, proximal, rows_out)
        else:
            names, metric_rows, dropped = self._pass_per_contributor(batch, proximal, rows_out)
        labels = [batch.contributors[c].hex()[:8] for c in names]
        metrics = self._apply(rows_out[: len(names)], names, labels, weights)
        metrics["aggregate/dropped_nonfinite"] = float(dropped)
        for key in metric_rows[0] if metric_rows else {}:
            metrics[key] = sum(r.get(key, 0.0) for r in metric_rows) / len(metric_rows)
        metrics.update(sample_counts(batch))
        return metrics

    def _rows_buffer(self, n: int) -> Tensor:
        """(n, d) float32, one row per contributor, written in place and kept between steps
        (a fresh one would be paged in again every step)."""
        d = sum(p.numel() for p in self.params)
        if self._rows is None or self._rows.shape[0] < n:
            self._rows = None
            self._rows = torch.empty((n, d), dtype=torch.float32)
        return self._rows[:n]

    def _pass_per_contributor(
        self, batch: TrainBatch, proximal: Tensor | None, rows_out: Tensor
    ) -> tuple[list[int], list[Metrics], int]:
        names: list[int] = []
        metric_rows: list[Metrics] = []
        dropped = 0
        for c in range(len(batch.contributors)):
            index = (batch.contributor == c).nonzero().flatten()
            if index.numel() == 0:
                continue
            rows = batch.rows(index)
            if proximal is not None:
                rows["proximal_logprobs"] = proximal[index]
            self.optimizer.zero_grad(set_to_none=False)
            result = self.runner.forward_backward(self._pad(rows), self._loss_fn)
            g = flat_grad(self.params, out=rows_out[len(names)])
            if not _all_stages([all_finite(g)])[0]:
                dropped += 1
                continue
            names.append(c)
            metric_rows.append(result.metrics)
        return names, metric_rows, dropped

    def _grouped(
        self, batch: TrainBatch, proximal: Tensor | None
    ) -> tuple[list[int], list[tuple[int, int]], dict[str, Tensor]]:
        """(contributors present, their row segments, the batch's rows ordered by contributor)."""
        order = torch.argsort(batch.contributor, stable=True)
        counts = torch.bincount(batch.contributor, minlength=len(batch.contributors)).tolist()
        present = [c for c, n in enumerate(counts) if n]
        bounds = torch.tensor([0, *counts]).cumsum(0).tolist()
        segments = [(bounds[c], bounds[c + 1]) for c in present]
        rows = batch.rows(order)
        if proximal is not None:
            rows["proximal_logprobs"] = proximal[order]
        return present, segments, rows

    def _gram_pass(
        self, batch: TrainBatch, proximal: Tensor | None, weights: Tensor | None
    ) -> tuple[list[int], list[Metrics], int, Metrics]:
        """One pass, the contributors' Gram matrix, the aggregator's coefficients from it,
        one weighted pass into ``.grad``, then clip and step (``_finish``)."""
        assert self.grouped is not None and isinstance(self.aggregator, GramAggregator)
        present, segments, rows = self._grouped(batch, proximal)
        if not present:
            self.optimizer.zero_grad(set_to_none=False)
            return [], [], 0, {"aggregate/contributors": 0.0}
        self.optimizer.zero_grad(set_to_none=False)
        with self.grouped.capture_gram(segments):
            result = self.runner.forward_backward(rows, self._segment_loss(segments))
        gram = (
            self.grouped.gram_sketch(self.gram_sketch, _secret_generator())
            if self.gram_sketch
            else self.grouped.gram()
        )
        finite = torch.isfinite(torch.diagonal(gram))  # K_ii = ||R_i||^2: finite iff R_i is
        keep = [i for i, ok in enumerate(_all_stages([bool(f) for f in finite])) if ok]
        names = [present[i] for i in keep]
        alpha = torch.zeros(len(present), dtype=torch.float64)
        if keep:
            sub = gram[keep][:, keep]
            w = None if weights is None else weights[torch.tensor(names)].to(torch.float64)
            alpha[keep] = (
                self.aggregator.coefficients(sub, w)
                if len(keep) > 1
                else torch.ones(1, dtype=torch.float64)
            )
        self.grouped.combine(alpha)
        labels = [batch.contributors[c].hex()[:8] for c in names]
        norms = torch.diagonal(gram)[keep].clamp(min=0.0).to(torch.float64)
        metrics = self._finish(norms, labels) if keep else {"aggregate/contributors": 0.0}
        metrics.update(weight_shares(alpha[keep], labels, norms.sqrt()))
        per_contributor = self._split_metrics(result.metrics, len(present))
        return names, [per_contributor[i] for i in keep], len(present) - len(keep), metrics

    def _segment_loss(
        self, segments: list[tuple[int, int]]
    ) -> Callable[..., tuple[Tensor, Metrics]]:
        def loss_fn(logprobs: Tensor, mb: Mapping[str, Any]) -> tuple[Tensor, Metrics]:
            """sum_c loss_c; c's metrics under ``"c/key"`` (the runner shares them with
            every stage)."""
            total = logprobs.new_zeros(())
            metrics: Metrics = {}
            for i, (lo, hi) in enumerate(segments):
                part = {
                    k: v[lo:hi] if isinstance(v, Tensor) and v.dim() else v for k, v in mb.items()
                }
                loss, own = self._loss_fn(logprobs[lo:hi], part)
                total = total + loss
                metrics.update({f"{i}/{k}": float(v) for k, v in own.items()})
            return total, metrics

        return loss_fn

    @staticmethod
    def _split_metrics(metrics: Metrics, n: int) -> list[Metrics]:
        per_contributor: list[Metrics] = [{} for _ in range(n)]
        for key, value in metrics.items():
            i, _, name = key.partition("/")
            per_contributor[int(i)][name] = value
        return per_contributor

    def _one_pass(
        self, batch: TrainBatch, proximal: Tensor | None, rows_out: Tensor
    ) -> tuple[list[int], list[Metrics], int]:
        assert self.grouped is not None
        present, segments, rows = self._grouped(batch, proximal)
        if not present:
            return [], [], 0
        out = rows_out[: len(present)]
        self.optimizer.zero_grad(set_to_none=False)
        with self.grouped.capture(segments, out):
            result = self.runner.forward_backward(rows, self._segment_loss(segments))
        per_contributor = self._split_metrics(result.metrics, len(present))
        keep = [i for i, ok in enumerate(_all_stages([all_finite(row) for row in out])) if ok]
        if len(keep) < len(present):
            rows_out[: len(keep)] = out[keep]
        return (
            [present[i] for i in keep],
            [per_contributor[i] for i in keep],
            len(present) - len(keep),
        )

    def _apply(
        self, stacked: Tensor, names: list[int], labels: list[str], weights: Tensor | None
    ) -> Metrics:
        """Aggregate ``stacked`` (n, d): one gradient row per contributor in ``names``."""
        self.optimizer.zero_grad(set_to_none=False)
        if not len(stacked):
            return {"aggregate/contributors": 0.0}
        w = None if weights is None else weights[torch.tensor(names)].to(torch.float64)
        agg = self.aggregator(stacked, w) if len(stacked) > 1 else stacked[0]
        write_grad(self.params, agg)
        norms = _squared_norms(stacked, self._spans)
        metrics = self._finish(norms, labels)
        # No coefficients here (the aggregator returns a vector): the nominal share, each
        # contributor's weight over the total.
        nominal = torch.ones(len(labels), dtype=torch.float64) if w is None else w
        metrics.update(weight_shares(nominal, labels, norms.sqrt()))
        return metrics

    def _finish(self, norms: Tensor, labels: list[str]) -> Metrics:
        """Clip ``.grad`` (the aggregate) by the global norm and step. ``norms`` (n,): each
        contributor's squared gradient norm on this stage."""
        agg_sq = sum(_squared_norm(p.grad) for p in self._counted if p.grad is not None)
        local = torch.cat([norms.double(), torch.tensor([agg_sq], dtype=torch.float64)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        per_contributor = local[:-1].sqrt()
        total = math.sqrt(float(local[-1]))
        if self.grad_clip > 0 and total > self.grad_clip:
            for p in self.params:
                assert p.grad is not None
                p.grad.mul_(self.grad_clip / (total + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: Metrics = {
            "aggregate/contributors": float(len(labels)),
            "aggregate/contributor_grad_norm_mean": float(per_contributor.mean()),
            "aggregate/contributor_grad_norm_max": float(per_contributor.max()),
            "train/grad_norm": total,
        }
        for i, label in enumerate(labels):
            metrics[f"aggregate/grad_norm/{label}"] = float(per_contributor[i])
        return metrics
