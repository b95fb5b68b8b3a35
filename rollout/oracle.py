"""Teacher-forced recomputation with a ``transformers`` causal LM.

:class:`TransformersOracle` implements ``verify.spotcheck.LogprobOracle`` and
``DistributionOracle``: batched forward passes over ``prompt + completion``
sequences whose logits are processed in float32 with
``verify.sampling.process_logits``. A batch takes one of three layouts, each
computing, for every sequence, what it would compute alone:

- **packed** (the default for short groups; ``rollout/packing.py``): the
  sequences that share a prompt become one row, the prompt then each
  completion, under an attention mask that lets each completion see the
  prompt and its own earlier tokens only: the prompt runs once, nothing is
  padded, and each batch is one forward call. A group packs when its row is at
  most ``max_packed_tokens`` wide; by default the width at which the masked
  attention would add ``PACKED_ATTENTION_SHARE`` to the row's linear-layer
  FLOPs (153 slots on the demo model, so a group of eight 16-token
  completions packs; about 3,700 on a 7B Llama), and never wider than an
  attention window or chunk the model's config names. Packing needs a model
  that honours a 4-D attention mask and position ids (``sdpa`` or ``eager``
  attention): the oracle checks each model it loads on a probe group as wide
  as its limit and uses the other layouts when packing does not give the
  padded layout's logits.
- **shared prefix**: the distinct prompts run once, left-padded, with a KV
  cache; the cache rows are repeated per sequence and the completions run on
  top of it, right-padded. A batch takes that path when it saves at least
  ``min_prefix_savings`` tokens over the padded one (the second forward call
  has a fixed cost: on the demo model, one group of eight saves too few
  tokens to pay for it and two groups save enough).
- **padded**: one row per sequence, padded on the left (default) or the
  right, with an attention mask and explicit position ids ``cumsum(mask) - 1``.

Logits are only projected for the positions a completion needs
(``logits_to_keep``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from rollout.backends import cache_kwarg, load_causal_lm, resolve_dtype
from rollout.packing import attention_span, pack, packed_width, packed_width_limit, unpack
from verify.errors import ProofTrainError
from verify.spotcheck import LogitsOracle

ModelSource = torch.nn.Module | str | Path
T = TypeVar("T")


class UnknownPolicyVersion(ProofTrainError):
    """The oracle holds no weights for the requested policy version."""


class TransformersOracle(LogitsOracle):
    """Recomputes processed logprobs for any policy version it can resolve.

    ``models`` maps a version to a module or a local model directory (loaded on
    first use and kept), or is a callable returning the module for a version.
    ``max_batch_tokens`` bounds ``rows * padded_length`` of one forward pass.
    """

    def __init__(
        self,
        models: Mapping[int, ModelSource] | Callable[[int], ModelSource],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        padding_side: str = "left",
        max_batch_tokens: int = 16_384,
        pad_token_id: int = 0,
        max_versions: int = 8,
        min_prefix_savings: int = 64,
        max_packed_tokens: int | None = None,
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if max_packed_tokens is not None and max_packed_tokens < 0:
            raise ValueError(
                "max_packed_tokens must be >= 0 (0: never pack; None: from the model's shape)"
            )
        self._models = models
        self._loaded: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self.max_versions = max(1, max_versions)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.padding_side = padding_side
        self.max_batch_tokens = max_batch_tokens
        self.pad_token_id = pad_token_id
        self.min_prefix_savings = min_prefix_savings
        self.max_packed_tokens = max_packed_tokens
        self._packs: dict[int, int] = {}  # version -> its packed width limit, 0 if it does not pack
        self._probed: dict[tuple, bool] = {}  # architecture -> whether packing matched
        self._lock = (
            threading.RLock()
        )  # loading, evicting and probing; forward passes run outside it

    def model(self, version: int) -> torch.nn.Module:
        with self._lock:
            if version not in self._loaded:
                if isinstance(self._models, Mapping):
                    if version not in self._models:
                        raise UnknownPolicyVersion(f"no weights for policy version {version}")
                    source = self._models[version]
                else:
                    source = self._models(version)
                self._loaded[version] = load_causal_lm(source, self.device, self.dtype)
                while (
                    len(self._loaded) > self.max_versions
                ):  # keep the staleness window, not history
                    self._packs.pop(self._loaded.popitem(last=False)[0], None)
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
        groups = _by_prompt(seqs)
        if limit := self._packed_limit(version, model):
            widths = [packed_width(seqs, g) for g in groups]
            self._run_packed_rows(
                model, seqs, [g for g, w in zip(groups, widths, strict=True) if w <= limit], result
            )
            groups = [g for g, w in zip(groups, widths, strict=True) if w > limit]
        if groups and self._prefix_pays(seqs, groups):
            self._run_groups(model, seqs, groups, result)
        elif groups:
            self._run_padded(model, seqs, [i for g in groups for i in g], result)
        return [r for r in result if r is not None]

    def packs(self, version: int) -> bool:
        """Whether this version's model runs the packed layout (module docstring); probed once."""
        return self._packed_limit(version, self.model(version)) > 0

    def _packed_limit(self, version: int, model: torch.nn.Module) -> int:
        """The widest packed row for this version's model, 0 if it does not pack; probed once."""
        with self._lock:
            if version not in self._packs:
                limit = (
                    packed_width_limit(model)
                    if self.max_packed_tokens is None
                    else self.max_packed_tokens
                )
                config = getattr(model, "config", None)
                if (
                    span := attention_span(config)
                ) is not None:  # a packed mask replaces a window's
                    limit = min(limit, span)  # own: rows no wider than it never need it
                impl = getattr(config, "_attn_implementation", None)
                packs = limit > 0 and impl in ("sdpa", "eager") and self._probe(model, limit)
                self._packs[version] = limit if packs else 0
            return self._packs[version]

    def _probe(self, model: torch.nn.Module, limit: int) -> bool:
        """:meth:`_packing_matches`, once per architecture: whether a model honours the
        packed mask and positions depends on its class, config, dtype and device, not on the
        values of its weights, so the versions of one policy share one probe."""
        config = getattr(model, "config", None)
        to_json = getattr(config, "to_json_string", None)
        shape = to_json() if callable(to_json) else repr(config)
        param = next(model.parameters())
        key = (type(model), shape, param.dtype, param.device, limit)
        if key not in self._probed:
            self._probed[key] = self._packing_matches(model, limit)
        return self._probed[key]

    def _packing_matches(self, model: torch.nn.Module, limit: int) -> bool:
        """The packed layout gives the padded layout's logits on a probe group as wide as
        ``limit``: one long completion, then two short ones at the far end of the row, so a
        model whose attention is local (a window or chunk no config field named), or which
        ignores the mask or the restarted positions, shows it. The bound is the larger of
        four times the padded layout's own batch-versus-alone difference and 1e-4 (float32)
        or 1e-2 (16-bit) of the largest logit."""
        positions = (
            getattr(getattr(model, "config", None), "max_position_embeddings", None) or limit
        )
        width = min(limit, positions)
        if width < 5:  # no room for a prompt and three completions
            return False
        vocab = _vocab_size(model)
        tok = [1 + (7 * i + 3) % max(vocab - 1, 1) for i in range(width)]
        p = min(3, width - 4)
        prompt, fed = tok[:p], width - p - 3  # p + fed + 2 + 1 = width slots
        seqs = [(prompt + tok[p : p + fed + 1], p), (prompt + tok[1:4], p), (prompt + tok[2:4], p)]
        padded: list[torch.Tensor | None] = [None] * len(seqs)
        alone: list[torch.Tensor | None] = [None] * len(seqs)
        packed: list[torch.Tensor | None] = [None] * len(seqs)
        self._run(model, seqs, [0, 1, 2], padded)
        for i in range(len(seqs)):
            self._run(model, seqs, [i], alone)
        try:
            self._run_packed(model, seqs, [[0, 1, 2]], packed)
        except (RuntimeError, ValueError, TypeError, IndexError):  # a model that refuses the inputs
            return False
        runs = [
            (g, w, a)
            for g, w, a in zip(packed, padded, alone, strict=True)
            if g is not None and w is not None and a is not None and g.shape == w.shape
        ]
        if len(runs) != len(seqs):
            return False
        scale = max(1.0, max(float(w.abs().max()) for _, w, _ in runs))
        noise = max(float((a - w).abs().max()) for _, w, a in runs)
        exact = next(model.parameters()).dtype in (torch.float32, torch.float64)
        bound = max(4 * noise, (1e-4 if exact else 1e-2) * scale)
        return all(float((g - w).abs().max()) <= bound for g, w, _ in runs)

    def _run_packed_rows(
        self,
        model: torch.nn.Module,
        seqs: Sequence[tuple[Sequence[int], int]],
        groups: list[list[int]],
        result: list[torch.Tensor | None],
    ) -> None:
        """Packed rows, longest first, batched within ``max_batch_tokens``."""
        for batch in _batches(groups, lambda g: packed_width(seqs, g), self.max_batch_tokens):
            self._run_packed(model, seqs, batch, result)

    @torch.inference_mode()
    def _run_packed(
        self,
        model: torch.nn.Module,
        seqs: Sequence[tuple[Sequence[int], int]],
        groups: list[list[int]],
        result: list[torch.Tensor | None],
    ) -> None:
        """One packed row per group (``rollout/packing.py``), all in one forward call."""
        batch = pack(seqs, groups, self.pad_token_id, next(model.parameters()).dtype)
        width = batch.input_ids.shape[1]
        logits = (
            model(
                input_ids=batch.input_ids.to(self.device),
                attention_mask=batch.attention_mask.to(self.device),
                position_ids=batch.position_ids.to(self.device),
                use_cache=False,
                logits_to_keep=width - batch.first,
            )
            .logits.float()
            .cpu()
        )  # (U, W - first, V)
        for i, part in unpack(logits, seqs, groups, batch.first):
            result[i] = part

    def _prefix_pays(
        self, seqs: Sequence[tuple[Sequence[int], int]], groups: list[list[int]]
    ) -> bool:
        """Whether the shared-prefix layout saves ``min_prefix_savings`` tokens over the padded one."""
        members = [i for g in groups for i in g]
        plain = sum(len(seqs[i][0]) for i in members)
        shared = sum(seqs[g[0]][1] for g in groups) + sum(
            len(seqs[i][0]) - seqs[i][1] for i in members
        )
        return plain - shared >= self.min_prefix_savings

    def _run_padded(
        self,
        model: torch.nn.Module,
        seqs: Sequence[tuple[Sequence[int], int]],
        members: list[int],
        result: list[torch.Tensor | None],
    ) -> None:
        """One padded row per sequence, longest first, batched within ``max_batch_tokens``."""
        for batch in _batches(members, lambda i: len(seqs[i][0]), self.max_batch_tokens):
            self._run(model, seqs, batch, result)

    def _run_groups(
        self,
        model: torch.nn.Module,
        seqs: Sequence[tuple[Sequence[int], int]],
        groups: list[list[int]],
        result: list[torch.Tensor | None],
    ) -> None:
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
    def _run_shared(
        self,
        model: torch.nn.Module,
        seqs: Sequence[tuple[Sequence[int], int]],
        groups: list[list[int]],
        result: list[torch.Tensor | None],
    ) -> None:
        prompts = [list(seqs[g[0]][0][: seqs[g[0]][1]]) for g in groups]
        ids, mask = self._padded(prompts, "left")
        out = model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(self.device),
            use_cache=True,
            logits_to_keep=1,
        )
        first = out.logits[:, -1].float().cpu()  # (U, V): each prompt's next-token logits
        members = [i for g in groups for i in g]
        rows = torch.tensor([u for u, g in enumerate(groups) for _ in g], dtype=torch.long)
        # The logits that predict completion tokens 1 .. n-1 come from feeding tokens 0 .. n-2.
        fed = [list(seqs[i][0][seqs[i][1] : len(seqs[i][0]) - 1]) for i in members]
        rest = None
        if any(fed):
            cache = getattr(out, cache_kwarg(model))
            cache.reorder_cache(rows.to(self.device))
            cids, cmask = self._padded(fed, "right")
            starts = mask.sum(-1)[rows]  # each row's real prompt length
            positions = starts[:, None] + torch.arange(cids.shape[1])[None, :]
            rest = (
                model(
                    input_ids=cids.to(self.device),
                    attention_mask=torch.cat([mask[rows], cmask], dim=1).to(self.device),
                    position_ids=positions.to(self.device),
                    use_cache=True,
                    **{cache_kwarg(model): cache},
                )
                .logits.float()
                .cpu()
            )  # (B, T, V)
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
            ids[k, off : off + len(r)] = torch.tensor(r, dtype=torch.long)
            mask[k, off : off + len(r)] = 1
        return ids, mask

    @torch.inference_mode()
    def _run(
        self,
        model: torch.nn.Module,
        seqs: Sequence[tuple[Sequence[int], int]],
        batch: list[int],
        result: list[torch.Tensor | None],
    ) -> None:
        lens = [len(seqs[i][0]) for i in batch]
        ids, mask = self._padded([list(seqs[i][0]) for i in batch], self.padding_side)
        width = ids.shape[1]
        offsets = [width - n if self.padding_side == "left" else 0 for n in lens]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        # Row b needs the logits at padded positions off+p-1 .. off+n-2.
        needed = [
            range(off + seqs[i][1] - 1, off + lens[row] - 1)
            for row, (i, off) in enumerate(zip(batch, offsets, strict=True))
        ]
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
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=False,
            logits_to_keep=_keep_arg(keep, width, self.device),
        )
        logits = out.logits.float().cpu()  # (B, K, V)
        if logits.shape[1] != len(keep):  # an int logits_to_keep kept a suffix
            logits = logits[:, -len(keep) :]
        for row, i in enumerate(batch):
            idx = torch.searchsorted(keep_t, torch.tensor(list(needed[row]), dtype=torch.long))
            result[i] = logits[row, idx].contiguous()


def _batches(items: list[T], width: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """``items`` widest first, cut into batches of at most ``budget`` rows * width (at least one row)."""
    batch: list[T] = []
    widest = 0  # the first item's width: every later one is at most that
    for w, item in sorted(((width(x), x) for x in items), key=lambda wx: -wx[0]):
        if batch and (len(batch) + 1) * widest > budget:
            yield batch
            batch = []
        if not batch:
            widest = w
        batch.append(item)
    if batch:
        yield batch


def _by_prompt(seqs: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
    """Indices of the sequences, grouped by prompt in order of first appearance."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, prompt_len) in enumerate(seqs):
        by_prompt.setdefault(tuple(ids[:prompt_len]), []).append(i)
    return list(by_prompt.values())


def _keep_arg(keep: list[int], width: int, device: torch.device) -> int | torch.Tensor:
    """A suffix as an int (every transformers version), else a 1-D index tensor."""
    if keep == list(range(width - len(keep), width)):
        return len(keep)
    return torch.tensor(keep, dtype=torch.long, device=device)


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()  # type: ignore[operator]
    return int(head.weight.shape[0])
