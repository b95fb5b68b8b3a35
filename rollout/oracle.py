"""Teacher-forced recomputation with a ``transformers`` causal LM.

:class:`TransformersOracle` implements ``verify.spotcheck.LogprobOracle`` and
``DistributionOracle``: one batched forward pass over ``prompt + completion``
sequences, padded on the left (default) or the right, with an attention mask
and explicit position ids ``cumsum(mask) - 1`` so a padded row computes what it
would compute alone. Logits are only projected for completion positions
(``logits_to_keep``), then processed in float32 with
``verify.sampling.process_logits``.

Sequences that share a prompt (the G rollouts of a group) can share its
forward pass, as generation does: the distinct prompts run once, left-padded,
with a KV cache; the cache rows are repeated per sequence and the completions
run on top of it, right-padded. A batch takes that path when it saves at
least ``min_prefix_savings`` tokens over the plain one (the second forward
call has a fixed cost: on the demo model, one group of eight saves too few
tokens to pay for it and two groups save enough).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from rollout.backends import cache_kwarg, load_causal_lm, resolve_dtype
from verify.errors import ProofTrainError
from verify.spotcheck import LogitsOracle

ModelSource = torch.nn.Module | str | Path


class UnknownPolicyVersion(ProofTrainError):
    """The oracle holds no weights for the requested policy version."""


class TransformersOracle(LogitsOracle):
    """Recomputes processed logprobs for any policy version it can resolve.

    ``models`` maps a version to a module or a local model directory (loaded on
    first use and kept), or is a callable returning the module for a version.
    ``max_batch_tokens`` bounds ``rows * padded_length`` of one forward pass.
    """

    def __init__(
        self, models: Mapping[int, ModelSource] | Callable[[int], ModelSource], *,
        device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
        padding_side: str = "left", max_batch_tokens: int = 16_384, pad_token_id: int = 0,
        max_versions: int = 8, min_prefix_savings: int = 64,
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self._models = models
        self._loaded: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self.max_versions = max(1, max_versions)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.padding_side = padding_side
        self.max_batch_tokens = max_batch_tokens
        self.pad_token_id = pad_token_id
        self.min_prefix_savings = min_prefix_savings

    def model(self, version: int) -> torch.nn.Module:
        if version not in self._loaded:
            if isinstance(self._models, Mapping):
                if version not in self._models:
                    raise UnknownPolicyVersion(f"no weights for policy version {version}")
                source = self._models[version]
            else:
                source = self._models(version)
            self._loaded[version] = load_causal_lm(source, self.device, self.dtype)
            while len(self._loaded) > self.max_versions:  # keep the staleness window, not history
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(version)
        return self._loaded[version]

    def logits_batch(
        self, version: int, seqs: Sequence[tuple[Sequence[int], int]]
    ) -> list[torch.Tensor]:
        """float32 CPU logits ``(T_i, V)`` for each ``(input_ids, prompt_len)``, input order kept."""
        for ids, prompt_len in seqs:
            if not 1 <= prompt_len <= len(ids):
                raise ValueError(f"prompt_len must be in [1, {len(ids)}], got {prompt_len}")
        model = self.model(version)
        result: list[torch.Tensor | None] = [None] * len(seqs)
        groups = self._shared_prompts(seqs)
        if groups:
            self._run_groups(model, seqs, groups, result)
            return [r for r in result if r is not None]
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        batch: list[int] = []
        for i in order:
            width = len(seqs[batch[0]][0]) if batch else len(seqs[i][0])
            if batch and (len(batch) + 1) * width > self.max_batch_tokens:
                self._run(model, seqs, batch, result)
                batch = []
            batch.append(i)
        if batch:
            self._run(model, seqs, batch, result)
        return [r for r in result if r is not None]

    def _shared_prompts(self, seqs: Sequence[tuple[Sequence[int], int]]) -> list[list[int]] | None:
        """Indices grouped by prompt when sharing prompts pays (module docstring), else None."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i, (ids, prompt_len) in enumerate(seqs):
            by_prompt.setdefault(tuple(ids[:prompt_len]), []).append(i)
        plain = sum(len(ids) for ids, _ in seqs)
        shared = sum(len(p) for p in by_prompt) + sum(len(ids) - p for ids, p in seqs)
        if plain - shared < self.min_prefix_savings:
            return None
        return list(by_prompt.values())

    def _run_groups(self, model: torch.nn.Module, seqs: Sequence[tuple[Sequence[int], int]],
                    groups: list[list[int]], result: list[torch.Tensor | None]) -> None:
        """Shared-prompt batches of whole groups, each within ``max_batch_tokens``."""
        batch: list[list[int]] = []
        tokens = 0
        for group in groups:
            cost = seqs[group[0]][1] + sum(len(seqs[i][0]) - seqs[i][1] for i in group)
            if batch and tokens + cost > self.max_batch_tokens:
                self._run_shared(model, seqs, batch, result)
                batch, tokens = [], 0
            batch.append(group)
            tokens += cost
        if batch:
            self._run_shared(model, seqs, batch, result)

    @torch.inference_mode()
    def _run_shared(self, model: torch.nn.Module, seqs: Sequence[tuple[Sequence[int], int]],
                    groups: list[list[int]], result: list[torch.Tensor | None]) -> None:
        prompts = [list(seqs[g[0]][0][: seqs[g[0]][1]]) for g in groups]
        ids, mask = self._padded(prompts, "left")
        out = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(self.device),
                    use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].float().cpu()  # (U, V): each prompt's next-token logits
        members = [i for g in groups for i in g]
        rows = torch.tensor([u for u, g in enumerate(groups) for _ in g], dtype=torch.long)
        # The logits that predict completion tokens 1 .. n-1 come from feeding tokens 0 .. n-2.
        fed = [list(seqs[i][0][seqs[i][1]: len(seqs[i][0]) - 1]) for i in members]
        rest = None
        if any(fed):
            cache = getattr(out, cache_kwarg(model))
            cache.reorder_cache(rows.to(self.device))
            cids, cmask = self._padded(fed, "right")
            starts = mask.sum(-1)[rows]  # each row's real prompt length
            positions = starts[:, None] + torch.arange(cids.shape[1])[None, :]
            rest = model(input_ids=cids.to(self.device),
                         attention_mask=torch.cat([mask[rows], cmask], dim=1).to(self.device),
                         position_ids=positions.to(self.device), use_cache=True,
                         **{cache_kwarg(model): cache}).logits.float().cpu()  # (B, T, V)
        for b, i in enumerate(members):
            n = len(seqs[i][0]) - seqs[i][1]
            if n == 0:
                result[i] = torch.empty((0, first.shape[-1]), dtype=torch.float32)
            elif rest is None or n == 1:
                result[i] = first[rows[b]][None].clone()
            else:
                result[i] = torch.cat([first[rows[b]][None], rest[b, : n - 1]]).contiguous()

    def _padded(self, rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):
            off = width - len(r) if side == "left" else 0
            ids[k, off:off + len(r)] = torch.tensor(r, dtype=torch.long)
            mask[k, off:off + len(r)] = 1
        return ids, mask

    @torch.inference_mode()
    def _run(self, model: torch.nn.Module, seqs: Sequence[tuple[Sequence[int], int]],
             batch: list[int], result: list[torch.Tensor | None]) -> None:
        lens = [len(seqs[i][0]) for i in batch]
        ids, mask = self._padded([list(seqs[i][0]) for i in batch], self.padding_side)
        width = ids.shape[1]
        offsets = [width - n if self.padding_side == "left" else 0 for n in lens]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        # Row b needs the logits at padded positions off+p-1 .. off+n-2.
        needed = [range(off + seqs[i][1] - 1, off + lens[row] - 1)
                  for row, (i, off) in enumerate(zip(batch, offsets, strict=True))]
        keep = sorted({p for r in needed for p in r})
        if keep and self.padding_side == "left":
            keep = list(range(keep[0], width))  # a suffix: one extra row, an int logits_to_keep
        if not keep:
            vocab = _vocab_size(model)
            for i in batch:
                result[i] = torch.empty((0, vocab), dtype=torch.float32)
            return
        keep_t = torch.tensor(keep, dtype=torch.long)
        out = model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device), use_cache=False,
            logits_to_keep=_keep_arg(keep, width, self.device),
        )
        logits = out.logits.float().cpu()  # (B, K, V)
        if logits.shape[1] != len(keep):  # an int logits_to_keep kept a suffix
            logits = logits[:, -len(keep):]
        for row, i in enumerate(batch):
            idx = torch.searchsorted(keep_t, torch.tensor(list(needed[row]), dtype=torch.long))
            result[i] = logits[row, idx].contiguous()


def _keep_arg(keep: list[int], width: int, device: torch.device) -> int | torch.Tensor:
    """A suffix as an int (every transformers version), else a 1-D index tensor."""
    if keep == list(range(width - len(keep), width)):
        return len(keep)
    return torch.tensor(keep, dtype=torch.long, device=device)


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()  # type: ignore[operator]
    return int(head.weight.shape[0])
