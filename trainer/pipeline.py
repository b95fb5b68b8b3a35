"""Pipeline runtime: micro-batches flow through S stage processes.

One process per stage, rank r runs stage r, over an initialised
``torch.distributed`` process group (gloo on CPU, NCCL on GPU). Activations
(B, T, H) go forward with ``isend``/``recv``; activation gradients come back
the same way. The default schedule is GPipe (all forwards, then all
backwards), which is a chain in both directions and cannot deadlock.

Invariants:
- Every rank is handed the same batch (token ids and per-sample tensors are
  small next to the weights), so receive buffers are sized locally and no shape
  metadata crosses the wire.
- ``forward_backward`` ends with an all-reduce that every rank must reach: it
  returns on all ranks or raises :class:`PipelineError` on all ranks. A rank
  that fails tears down its process group, so its peers fail within a second
  instead of waiting for the group timeout; the timeout is the backstop for a
  peer that hangs. After a failure the runner refuses further work; let the
  error end the process, and ``torchrun --max-restarts`` restarts every stage,
  which resumes from its last checkpoint (``trainer.stages.save_stage``).
- Gradients accumulate into ``.grad`` (scaled by 1/M over M micro-batches) and
  are never zeroed here; the tied embedding copies (see ``trainer.stages``) get
  the sum of both stages' gradients before this call returns.
- S = 1 runs the same code with no communication but the final all-reduce.
- :class:`PipelineOracle` answers ``verify.spotcheck.LogprobOracle`` requests
  for any policy version through the same stages, one stage per process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from trainer.logprobs import kept_positions, token_logprobs, token_logprobs_at
from trainer.stages import Stage
from verify.errors import ConfigError, ProofTrainError

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

LossFn = Callable[[torch.Tensor, Mapping[str, Any]], tuple[torch.Tensor, Mapping[str, float]]]
"""``loss_fn(logprobs (b, T-1), micro_batch) -> (scalar loss, metrics)``.

When the micro-batch holds ``target_mask`` (b, T-1), the loss may read ``logprobs``
only where it is non-zero: elsewhere they are 0 and the head was never applied."""

Action = tuple[str, int]
"""``("F", i)`` or ``("B", i)``: forward or backward of micro-batch i."""


class PipelineError(ProofTrainError):
    """A pipeline step did not complete on every stage. No rank may step its optimizer."""

    def __init__(self, message: str, *, stage: int, phase: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.phase = phase


def split_microbatches(batch: Mapping[str, Any], num_microbatches: int) -> list[dict[str, Any]]:
    """Slice every tensor with a batch dimension into M equal parts along dim 0.

    Scalars, 0-d tensors and non-tensors are passed unchanged to every part.
    """
    size = batch["input_ids"].shape[0]
    if num_microbatches < 1 or size % num_microbatches:
        raise ConfigError(f"batch of {size} does not split into {num_microbatches} micro-batches")
    step = size // num_microbatches
    parts: list[dict[str, Any]] = [{} for _ in range(num_microbatches)]
    for key, value in batch.items():
        batched = isinstance(value, torch.Tensor) and value.dim() > 0
        if batched and value.shape[0] != size:
            raise ConfigError(f"batch[{key!r}] has {value.shape[0]} rows, input_ids has {size}")
        for i, part in enumerate(parts):
            part[key] = value[i * step : (i + 1) * step] if batched else value
    return parts


class Schedule(Protocol):
    """Orders the forward and backward actions of one stage for one step.

    Every stage's list must issue its sends and receives in an order that its
    neighbours' lists match.
    """

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]: ...


class GPipe:
    """All forwards, then all backwards, in micro-batch order on every stage."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        m = range(num_microbatches)
        return [("F", i) for i in m] + [("B", i) for i in m]


SCHEDULES: dict[str, Schedule] = {"gpipe": GPipe()}


@dataclass(frozen=True)
class StepResult:
    """What ``forward_backward`` returns on every rank."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Slot:
    """The autograd ends of one micro-batch on this stage."""

    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    loss: torch.Tensor | None = None


class PipelineRunner:
    """Runs one stage of a pipeline on rank ``rank`` of ``world``.

    ``rank`` is the stage index and ``world`` the number of stages; the process
    group must already be initialised (see ``trainer.launch.init_distributed``).
    Every rank makes the same sequence of calls (a tied-embedding model creates
    a sub-group of the first and last rank on its first training step).
    ``num_microbatches`` must divide the batch size; ``temperature`` scales the
    logits behind the training logprobs; ``seed`` seeds torch on this rank.
    """

    def __init__(
        self,
        stage: Stage,
        rank: int,
        world: int,
        *,
        num_microbatches: int = 1,
        temperature: float = 1.0,
        schedule: str = "gpipe",
        seed: int | None = None,
    ) -> None:
        if stage.spec.index != rank or stage.spec.num_stages != world:
            raise ConfigError(
                f"rank {rank}/{world} was given stage {stage.spec.index}/{stage.spec.num_stages}"
            )
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {schedule!r}; known: {sorted(SCHEDULES)}")
        if not dist.is_initialized() or dist.get_world_size() != world:
            raise ConfigError(f"need an initialised process group of {world} ranks")
        if seed is not None:
            torch.manual_seed(seed)
        self.stage = stage
        self.rank = rank
        self.world = world
        self.num_microbatches = num_microbatches
        self.temperature = temperature
        self.schedule = SCHEDULES[schedule]
        param = next(stage.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._tied = bool(getattr(stage.config, "tie_word_embeddings", False)) and world > 1
        self._tied_group: Any = None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._where = "idle"
        self._failed: PipelineError | None = None

    @classmethod
    def for_config(
        cls, stage: Stage, cfg: TrainerConfig, rank: int = 0, world: int = 1
    ) -> PipelineRunner:
        """The runner a trainer configured by ``cfg`` uses for ``stage``: its microbatches,
        its rollouts' sampling temperature and its seed."""
        return cls(
            stage,
            rank,
            world,
            num_microbatches=cfg.microbatches,
            temperature=cfg.local.temperature,
            seed=cfg.seed,
        )

    @property
    def ties_across_stages(self) -> bool:
        """Whether the first and last stage hold copies of one tied embedding."""
        return self._tied

    # -- public API

    def forward_backward(self, batch: Mapping[str, Any], loss_fn: LossFn) -> StepResult:
        """Forward and backward one batch; returns the mean micro-batch loss on every rank.

        ``batch`` holds ``input_ids`` (B, T) and optionally ``attention_mask``,
        ``position_ids`` and whatever ``loss_fn`` reads. Call ``optimizer.step()``
        only after this returns.
        """
        parts = split_microbatches(batch, self.num_microbatches)
        return self._guard("forward_backward", lambda: self._train_step(parts, loss_fn))

    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        temperature: float | None = None,
        position_ids: torch.Tensor | None = None,
        to_rank: int | None = None,
        target_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Teacher-forced per-token logprobs (B, T-1), float32, without gradients.

        Every rank calls this with the same inputs. The result is returned on the
        last stage, or on ``to_rank`` when given; other ranks get ``None``. With
        ``target_mask`` (B, T-1), only its non-zero positions are computed (the rest are 0).
        """
        temp = self.temperature if temperature is None else temperature
        mb = model_inputs(input_ids, attention_mask, position_ids)
        kept = None if target_mask is None else kept_positions(target_mask)

        def run() -> torch.Tensor | None:
            logits = self._infer(mb, None if kept is None else kept[0])
            if logits is None:
                lp = None
            elif kept is None:
                lp = token_logprobs(logits, input_ids, temp)
            else:
                lp = token_logprobs_at(logits, input_ids, *kept, temp)
            return self._deliver(lp, input_ids, to_rank)

        return self._guard("logprobs", run)

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Raw logits (B, T, V) on the last stage (``None`` elsewhere), without gradients."""
        mb = model_inputs(input_ids, attention_mask, position_ids)
        return self._guard("logits", lambda: self._infer(mb))

    # -- one step

    def _train_step(self, parts: list[dict[str, Any]], loss_fn: LossFn) -> StepResult:
        m = len(parts)
        slots = [_Slot() for _ in parts]
        metric_sums: dict[str, float] = {}
        loss_sum = 0.0
        for kind, i in self.schedule.actions(self.rank, self.world, m):
            self._where = f"{'forward' if kind == 'F' else 'backward'} of micro-batch {i}"
            if kind == "F":
                mask = parts[i].get("target_mask")
                kept = None if mask is None else kept_positions(mask)
                slots[i] = self._forward(
                    parts[i], requires_grad=True, keep=None if kept is None else kept[0]
                )
                logits = slots[i].out  # last stage: (b, K, V) with a target_mask, else (b, T, V)
                if self.stage.spec.is_last and logits is not None:
                    ids = parts[i]["input_ids"]
                    lp = (
                        token_logprobs(logits, ids, self.temperature)
                        if kept is None
                        else token_logprobs_at(logits, ids, *kept, self.temperature)
                    )
                    loss, metrics = loss_fn(lp, parts[i])
                    if loss.dim() != 0:
                        raise ConfigError(f"loss_fn must return a scalar, got {tuple(loss.shape)}")
                    slots[i].loss = loss / m
                    loss_sum += float(loss.detach())
                    for key, value in metrics.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
                    slots[i].out = None
            else:
                self._backward(slots[i])
                slots[i] = _Slot()
        self._where = "tied-embedding gradient sum"
        self._sum_tied_grads()
        self._where = "step commit"
        self._drain_sends()
        # Commit point: every rank must arrive, so no rank returns if another failed.
        total = torch.tensor([loss_sum / m], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        shared = [{k: v / m for k, v in metric_sums.items()}]
        dist.broadcast_object_list(shared, src=self.world - 1)
        return StepResult(loss=float(total.item()), metrics=shared[0])

    def _forward(
        self, mb: Mapping[str, Any], *, requires_grad: bool, keep: torch.Tensor | None = None
    ) -> _Slot:
        spec = self.stage.spec
        if spec.is_first:
            inp = mb["input_ids"].to(self.device)
        else:
            ids = mb["input_ids"]
            inp = torch.empty(
                (*ids.shape, self.stage.config.hidden_size), dtype=self.dtype, device=self.device
            )
            dist.recv(inp, src=self.rank - 1)
            inp.requires_grad_(requires_grad)
        mask = mb.get("attention_mask")
        pos = mb.get("position_ids")
        with torch.set_grad_enabled(requires_grad):
            out = self.stage(
                inp,
                None if mask is None else mask.to(self.device),
                None if pos is None else pos.to(self.device),
                keep=None if keep is None or not spec.is_last else keep.to(self.device),
            )
        if not spec.is_last:
            self._isend(out.detach(), self.rank + 1)
        return _Slot(inp=None if spec.is_first else inp, out=out)

    def _backward(self, slot: _Slot) -> None:
        if self.stage.spec.is_last:
            assert slot.loss is not None
            slot.loss.backward()
        else:
            assert slot.out is not None
            grad = torch.empty_like(slot.out)
            dist.recv(grad, src=self.rank + 1)
            torch.autograd.backward(slot.out, grad_tensors=grad)
        if not self.stage.spec.is_first:
            assert slot.inp is not None and slot.inp.grad is not None
            self._isend(slot.inp.grad, self.rank - 1)

    def _infer(
        self, mb: Mapping[str, Any], keep: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        self._where = "inference forward"
        with torch.no_grad():
            slot = self._forward(mb, requires_grad=False, keep=keep)
        self._drain_sends()
        return slot.out if self.stage.spec.is_last else None

    def _deliver(
        self, lp: torch.Tensor | None, input_ids: torch.Tensor, to_rank: int | None
    ) -> torch.Tensor | None:
        last = self.world - 1
        if to_rank is None or to_rank == last:
            return lp
        self._where = f"sending logprobs to rank {to_rank}"
        if self.rank == last:
            assert lp is not None
            dist.send(lp.contiguous(), dst=to_rank)
            return None
        if self.rank != to_rank:
            return None
        out = torch.empty(
            (input_ids.shape[0], input_ids.shape[1] - 1), dtype=torch.float32, device=self.device
        )
        dist.recv(out, src=last)
        return out

    # -- communication and failure

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=dst)
        assert work is not None
        self._sends.append((work, tensor))

    def _drain_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def _sum_tied_grads(self) -> None:
        if not self._tied:
            return
        if self._tied_group is None:
            # Collective over all ranks; created on the first training step only.
            self._tied_group = dist.new_group([0, self.world - 1])
        if not self.stage.owns_tied_embedding:
            return
        weight = self.stage.tied_parameter()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self._tied_group)

    def _guard(self, phase: str, body: Callable[[], Any]) -> Any:
        if self._failed is not None:
            raise PipelineError(
                f"stage {self.rank} refuses {phase}: an earlier step failed ({self._failed})",
                stage=self.rank,
                phase=phase,
            )
        try:
            return body()
        except Exception as exc:
            where = self._where
            self._abort()
            self._failed = PipelineError(
                f"stage {self.rank}/{self.world} failed in {phase} ({where}): "
                f"{type(exc).__name__}: {exc}",
                stage=self.rank,
                phase=phase,
            )
            raise self._failed from exc
        finally:
            self._sends = []
            self._where = "idle"

    def _abort(self) -> None:
        abort_process_group()


def model_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
) -> dict[str, Any]:
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def abort_process_group() -> None:
    """Tear the process group down so blocked peers fail now, not at the timeout."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
