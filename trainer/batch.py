"""Accepted samples -> padded training tensors.

One row per accepted completion; the sequence is ``prompt_ids + token_ids``,
right-padded to the longest row::

    input_ids           (B, T)    long, pad_id after the row's end
    attention_mask      (B, T)    long, 1 on real tokens
    target_mask         (B, T-1)  float, 1 where input_ids[:, t+1] is a completion token
    behaviour_logprobs  (B, T-1)  float32, the committed logprob of input_ids[:, t+1]
                                  (0 where target_mask is 0)
    advantages          (B,)      group-normalized (``trainer.losses.group_advantages``)
    rewards, staleness, lengths, group_ids, contributor   (B,)

Invariants:
- Groups are whole. The validator accepts or rejects a group as one, and every
  member shares its policy version, so staleness filtering keeps or drops a
  group as one. A group with fewer rows than its ``group_size`` is *refused*
  (``BatchError``): the buffer only releases complete groups, so an incomplete
  one here is a bug upstream, not data to guess about.
- Behaviour logprobs are the committed ones, aligned so that
  ``behaviour_logprobs[b, t]`` and the trainer's ``logprobs[b, t]`` score the
  same token ``input_ids[b, t+1]``.
- The trainer recomputes logprobs at one temperature without top-k/top-p, so
  every sample must have been drawn at that temperature with ``top_k = 0`` and
  ``top_p = 1``; anything else is refused rather than silently mis-weighted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.losses import group_advantages
from verify.errors import ProofTrainError
from verify.types import AcceptedSample

_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")


class BatchError(ProofTrainError):
    """Samples that cannot form a training batch (incomplete group, wrong sampling params)."""


Group = tuple[AcceptedSample, ...]
"""The members of one assignment, ordered by ``group_index``."""


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors for one step; see the module docstring for shapes."""

    input_ids: Tensor
    attention_mask: Tensor
    target_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    rewards: Tensor
    staleness: Tensor
    lengths: Tensor
    group_ids: Tensor
    contributor: Tensor
    contributors: tuple[bytes, ...]
    """Contributor keys; ``contributor[b]`` indexes this tuple."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, index: Tensor) -> dict[str, Tensor]:
        """The per-row tensors of ``index`` as a runner batch dict."""
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "target_mask": self.target_mask[index],
            "behaviour_logprobs": self.behaviour_logprobs[index],
            "advantages": self.advantages[index],
        }


def tokens(sample: AcceptedSample) -> np.ndarray:
    return np.frombuffer(sample.token_ids, dtype=_U32)


def check_group(group: Sequence[AcceptedSample]) -> None:
    """Raise ``BatchError`` unless ``group`` is exactly members 0..G-1 of one assignment."""
    if not group:
        raise BatchError("empty group")
    first = group[0]
    if len(group) != first.group_size:
        raise BatchError(f"group has {len(group)} of {first.group_size} members")
    if sorted(s.group_index for s in group) != list(range(first.group_size)):
        raise BatchError("group members are not 0..G-1")
    for s in group:
        if s.assignment_id != first.assignment_id or s.policy_version != first.policy_version:
            raise BatchError("group mixes assignments or policy versions")


def build_batch(
    groups: Sequence[Group],
    version: int,
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    normalize_std: bool = True,
) -> TrainBatch:
    """Stack ``groups`` (trained at policy ``version``) into one padded batch."""
    if not groups:
        raise BatchError("no groups")
    samples: list[AcceptedSample] = []
    group_ids: list[int] = []
    for g, group in enumerate(groups):
        check_group(group)
        samples.extend(group)
        group_ids.extend([g] * len(group))
    keys: dict[bytes, int] = {}
    rows = []
    for s in samples:
        if abs(s.temperature - temperature) > 1e-6 or s.top_k != 0 or s.top_p != 1.0:
            raise BatchError(
                f"sample drawn with temperature={s.temperature}, top_k={s.top_k}, "
                f"top_p={s.top_p}; the trainer scores temperature={temperature} without top-k/p"
            )
        prompt = np.frombuffer(s.prompt_ids, dtype=_U32)
        completion = tokens(s)
        lp = np.frombuffer(s.logprobs, dtype=_F32)
        if lp.size != completion.size or prompt.size == 0:
            raise BatchError("sample has mismatched token and logprob lengths or no prompt")
        rows.append((prompt, completion, lp))
        keys.setdefault(s.contributor_key, len(keys))
    width = max(p.size + c.size for p, c, _ in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    target = torch.zeros((n, width - 1), dtype=torch.float32)
    behaviour = torch.zeros((n, width - 1), dtype=torch.float32)
    for b, (prompt, completion, lp) in enumerate(rows):
        p, c = prompt.size, completion.size
        seq = np.concatenate([prompt, completion]).astype(np.int64)
        input_ids[b, : p + c] = torch.from_numpy(seq)
        attention[b, : p + c] = 1
        # logprobs[:, t] scores input_ids[:, t+1]: completion token j sits at p + j.
        target[b, p - 1 : p - 1 + c] = 1.0
        behaviour[b, p - 1 : p - 1 + c] = torch.from_numpy(lp.astype(np.float32))
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    gids = torch.tensor(group_ids, dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        target_mask=target,
        behaviour_logprobs=behaviour,
        advantages=group_advantages(rewards, gids, normalize_std=normalize_std),
        rewards=rewards,
        staleness=torch.tensor([version - s.policy_version for s in samples], dtype=torch.long),
        lengths=torch.tensor([r[1].size for r in rows], dtype=torch.long),
        group_ids=gids,
        contributor=torch.tensor([keys[s.contributor_key] for s in samples], dtype=torch.long),
        contributors=tuple(keys),
    )


def uniform_reward(group: Group) -> bool:
    """True when every member has the same reward: zero advantage, no learning signal."""
    return len({s.reward for s in group}) <= 1
