"""Teacher-forced recomputation through the pipeline stages, for spot checks.

A :class:`PipelineOracle` lets a validator recompute logprobs for any policy
version while no process holds the full weights: rank 0 takes the oracle
calls and broadcasts each request; every rank loads only its own stage of the
requested version and the pipeline runs the forward pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.pipeline import PipelineError, PipelineRunner, abort_process_group
from trainer.stages import load_stage
from verify.errors import ConfigError
from verify.spotcheck import LogitsOracle

_STOP, _LOGITS = 0, 1


class PipelineOracle(LogitsOracle):
    """``verify.spotcheck.LogprobOracle`` and ``DistributionOracle`` answered by the stages.

    Rank 0 takes the calls; every other rank runs :meth:`serve` until rank 0
    calls :meth:`close`. Per request rank 0 broadcasts ``(command, version, B,
    L)``, the token ids, the mask and the prompt lengths; each rank loads only
    its own stage of that version (``resolve(version)`` is a local model
    directory) and the last stage sends rank 0 only the logits at completion
    positions. Rows are left-padded with ``position_ids = cumsum(mask) - 1``,
    as in ``rollout.oracle.TransformersOracle``, so a padded row computes what
    it would compute alone. No process ever holds more than its stage of a version.
    """

    def __init__(
        self,
        resolve: Callable[[int], str | Path],
        rank: int,
        world: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        pad_token_id: int = 0,
        cached_versions: int = 1,
    ) -> None:
        self.resolve, self.rank, self.world = resolve, rank, world
        self.device, self.dtype = torch.device(device), dtype
        self.pad_token_id = pad_token_id
        self.cached_versions = max(1, cached_versions)
        self._runners: OrderedDict[int, PipelineRunner] = OrderedDict()

    def logits_batch(
        self, version: int, seqs: Sequence[tuple[Sequence[int], int]]
    ) -> list[torch.Tensor]:
        """float32 CPU logits (n_i, V) at the completion positions of each sequence."""
        if self.rank != 0:
            raise ConfigError("only rank 0 answers oracle requests; other ranks run serve()")
        if not Path(self.resolve(version)).is_dir():
            raise ConfigError(f"no model directory for policy version {version}")
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (seq, prompt_len) in enumerate(seqs):
            if not 1 <= prompt_len <= len(seq):
                raise ConfigError(f"prompt_len must be in [1, {len(seq)}], got {prompt_len}")
            ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        prompts = torch.tensor([p for _, p in seqs], dtype=torch.long)
        header = torch.tensor([_LOGITS, version, len(seqs), width], dtype=torch.long)
        self._broadcast(header)
        result = self._round(version, ids, mask, prompts)
        assert result is not None
        return result

    def serve(self) -> None:
        """Answer rank 0's requests until it calls :meth:`close` (ranks 1..S-1)."""
        while True:
            header = self._broadcast(torch.empty(4, dtype=torch.long))
            command, version, rows, width = (int(v) for v in header)
            if command == _STOP:
                return
            ids = torch.empty((rows, width), dtype=torch.long)
            self._round(version, ids, torch.empty_like(ids), torch.empty(rows, dtype=torch.long))

    def close(self) -> None:
        """Release the serving ranks (rank 0)."""
        if self.rank == 0 and dist.is_initialized():
            self._broadcast(torch.tensor([_STOP, 0, 0, 0], dtype=torch.long))

    # -- one request on every rank

    def _round(
        self, version: int, ids: torch.Tensor, mask: torch.Tensor, prompts: torch.Tensor
    ) -> list[torch.Tensor] | None:
        try:
            for t in (ids, mask, prompts):
                t.copy_(self._broadcast(t))
            runner = self._runner(version)
        except Exception as exc:
            abort_process_group()
            raise PipelineError(
                f"stage {self.rank} failed to prepare version {version}: {exc}",
                stage=self.rank,
                phase="oracle",
            ) from exc
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        logits = runner.logits(ids, mask, position_ids=positions)  # (B, L, V) on the last stage
        width = ids.shape[1]
        lengths = mask.sum(-1).tolist()
        spans = [
            (width - n + p - 1, width - 1) for n, p in zip(lengths, prompts.tolist(), strict=True)
        ]
        sizes = [b - a for a, b in spans]
        last = self.world - 1
        packed = None
        if self.rank == last:
            assert logits is not None
            packed = torch.cat([logits[row, a:b] for row, (a, b) in enumerate(spans)]).float()
        return runner._guard("oracle", lambda: self._collect(packed, sizes, runner))

    def _collect(
        self, packed: torch.Tensor | None, sizes: list[int], runner: PipelineRunner
    ) -> list[torch.Tensor] | None:
        last = self.world - 1
        if self.world > 1 and self.rank == last:
            assert packed is not None
            dist.send(packed.contiguous(), dst=0)
            return None
        if self.rank != 0:
            return None
        if packed is None:
            vocab = runner.stage.config.vocab_size
            packed = torch.empty((sum(sizes), vocab), dtype=torch.float32, device=self.device)
            dist.recv(packed, src=last)
        return [t.cpu() for t in torch.split(packed, sizes)]

    def _runner(self, version: int) -> PipelineRunner:
        if version not in self._runners:
            stage = load_stage(
                self.resolve(version), self.rank, self.world, device=self.device, dtype=self.dtype
            )
            self._runners[version] = PipelineRunner(stage, self.rank, self.world)
            while len(self._runners) > self.cached_versions:
                self._runners.popitem(last=False)
        self._runners.move_to_end(version)
        return self._runners[version]

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(self.device)
        if self.world > 1:
            dist.broadcast(on_device, src=0)
        return on_device.cpu()
