"""The packed forward layout of teacher-forced recomputation (``rollout/oracle.py``).

The sequences that share a prompt (the G rollouts of a group) become one row:
``prompt, completion 1[:-1], completion 2[:-1], ...``. Its attention mask lets
each completion see the prompt and its own earlier tokens only, and its
position ids restart after the prompt for each completion, so every slot
computes what it would compute in the completion's own padded row. The
prompt runs once and a completion's last token, whose logits nothing needs,
is never fed.

A completion attends over the whole row, masked, so a row's attention grows
with the square of its width: :func:`packed_width_limit` gives the widest
row worth packing, and :func:`attention_span` the widest a model whose
attention is local can take (its own window or chunk would be replaced by
the packed mask). Pure: tensors in, tensors out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Seqs = Sequence[tuple[Sequence[int], int]]
"""``(input_ids, prompt_len)`` per sequence."""

PACKED_ATTENTION_SHARE = 0.15
"""The masked attention a packed row may add to its linear layers' FLOPs. Measured on
the demo model, one torch thread, groups of eight: packing is as fast as the shared
prefix at 127 slots, 5-14% slower at 255 and 37-51% slower at 511 (one and seven
groups per call)."""


@dataclass(frozen=True)
class PackedBatch:
    """The model inputs of packed rows, one per group, right-padded to one width ``W``."""

    input_ids: torch.Tensor  # (U, W) long
    position_ids: torch.Tensor  # (U, W) long
    attention_mask: (
        torch.Tensor
    )  # (U, 1, W, W) additive: 0 where a query sees a key, else dtype min
    first: int
    """The first slot whose logits are needed (the shortest prompt's last): keep ``W - first``."""


def packed_width(seqs: Seqs, group: list[int]) -> int:
    """Slots of a group's packed row: its prompt, then every completion but its last token."""
    prompt_len = seqs[group[0]][1]
    return prompt_len + sum(max(len(seqs[i][0]) - prompt_len - 1, 0) for i in group)


def pack(seqs: Seqs, groups: list[list[int]], pad_token_id: int, dtype: torch.dtype) -> PackedBatch:
    """One row per group (indices into ``seqs`` that share a prompt).

    ``seg`` names what each slot holds: 0 the prompt, k member k, -1 padding.
    A query sees a key at or before it that is the prompt or its own member; a
    padding slot sees itself, so no row of the mask is empty.
    """
    ids_rows, pos_rows, seg_rows = [], [], []
    for g in groups:
        prompt_len = seqs[g[0]][1]
        ids, pos, seg = list(seqs[g[0]][0][:prompt_len]), list(range(prompt_len)), [0] * prompt_len
        for k, i in enumerate(g, 1):
            fed = seqs[i][0][prompt_len : len(seqs[i][0]) - 1]  # the last token predicts nothing
            ids.extend(fed)
            pos.extend(range(prompt_len, prompt_len + len(fed)))
            seg.extend([k] * len(fed))
        ids_rows.append(ids)
        pos_rows.append(pos)
        seg_rows.append(seg)
    width = max(len(r) for r in ids_rows)
    ids_t = torch.tensor(
        [r + [pad_token_id] * (width - len(r)) for r in ids_rows], dtype=torch.long
    )
    pos_t = torch.tensor([r + [0] * (width - len(r)) for r in pos_rows], dtype=torch.long)
    seg_t = torch.tensor(
        [r + [-1] * (width - len(r)) for r in seg_rows], dtype=torch.long
    )  # (U, W)
    slots = torch.arange(width)
    query, key = seg_t[:, :, None], seg_t[:, None, :]
    sees = ((key == 0) | (key == query)) & (key >= 0) & (slots[:, None] >= slots[None, :])
    sees |= torch.eye(width, dtype=torch.bool)
    mask = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, torch.finfo(dtype).min)
    first = min(seqs[g[0]][1] for g in groups) - 1
    return PackedBatch(ids_t, pos_t, mask[:, None], first)


def unpack(
    logits: torch.Tensor,
    seqs: Seqs,
    groups: list[list[int]],
    first: int,
) -> list[tuple[int, torch.Tensor]]:
    """``(index, (T_i, V) logits)`` of every sequence of ``groups`` from the rows' kept
    logits ``(U, W - first, V)``: each completion's first token is predicted by its
    prompt's last slot, the rest by its own fed tokens."""
    rows: list[int] = []
    cols: list[int] = []
    sizes: list[int] = []
    members: list[int] = []
    for u, g in enumerate(groups):
        prompt_len = seqs[g[0]][1]
        at = prompt_len
        for i in g:
            n = len(seqs[i][0]) - prompt_len
            if n:
                rows.extend([u] * n)
                cols.append(prompt_len - 1 - first)
                cols.extend(range(at - first, at - first + n - 1))
                at += n - 1
            sizes.append(n)
            members.append(i)
    picked = logits[
        torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    ]  # (sum n, V)
    return list(zip(members, picked.split(sizes), strict=True))


def attention_span(config: object) -> int | None:
    """The narrowest attention span a causal LM's config names (a sliding window, a local
    window, an attention chunk; in it or in its ``text_config``), or None."""
    spans = [
        v
        for c in (config, getattr(config, "text_config", None))
        for name in ("sliding_window", "window_size", "attention_chunk_size")
        if isinstance(v := getattr(c, name, None), int) and not isinstance(v, bool) and v > 0
    ]
    return min(spans, default=None)


def packed_width_limit(model: torch.nn.Module) -> int:
    """The widest packed row whose attention adds at most ``PACKED_ATTENTION_SHARE`` to its
    linear layers' FLOPs: per layer, ``2 * P`` per slot for ``P`` matrix weights (every 2-D
    weight but the embeddings' and the output head's) against
    ``4 * heads * head_dim`` per slot pair, over the ``W^2`` pairs of a row of ``W``. 0
    when the model's shape is not one that can be read."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // (
        heads or 1
    )
    if not layers or not heads or not head_dim:
        return 0
    head = model.get_output_embeddings()  # type: ignore[operator]
    weights = [
        getattr(m, "weight", None)
        for m in model.modules()
        if m is not head and not isinstance(m, torch.nn.Embedding)
    ]
    linear = sum(
        w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2
    )  # and Conv1D
    return int(PACKED_ATTENTION_SHARE * 2 * linear / layers / (4 * heads * head_dim))
