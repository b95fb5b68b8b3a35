"""The in-process network's policy versions in memory, and the spot-check oracle over them.

Invariants:
- :class:`VersionRegistry` holds version 0 (the base model) always and, of
  the others, only the newest ``keep`` (at least one): adding version v drops
  every version in ``1 .. v - keep``. Every model it hands out is in eval mode.
- :meth:`VersionRegistry.add` returns the models it dropped: the caller may
  reuse their memory, since the registry no longer hands them out.
- Asking for a version it does not hold raises ``UnknownPolicyVersion``, the
  error the spot-check oracle and the contributor sync raise for it too.
- :class:`RegistryOracle` recomputes under the registry's models and keeps no
  per-version cache of its own, so its memory is bounded by the registry's.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rollout.oracle import TransformersOracle, UnknownPolicyVersion


class VersionRegistry:
    """Policy version -> model, keeping only the newest ``keep`` versions (and 0 never)."""

    def __init__(self, base: PreTrainedModel, keep: int) -> None:
        self.keep = max(1, keep)
        self._models: dict[int, PreTrainedModel] = {0: base}

    def __getitem__(self, version: int) -> PreTrainedModel:
        try:
            return self._models[version]
        except KeyError:
            raise UnknownPolicyVersion(f"no weights for policy version {version}") from None

    def __contains__(self, version: int) -> bool:
        return version in self._models

    @property
    def newest(self) -> int:
        return max(self._models)

    def add(self, version: int, model: PreTrainedModel) -> list[PreTrainedModel]:
        """Hold ``model`` as ``version``; return the models of the versions this drops."""
        self._models[version] = model.eval()
        return [self._models.pop(v) for v in sorted(self._models) if 0 < v <= version - self.keep]


class RegistryOracle(TransformersOracle):
    """The spot-check oracle over the registry (no per-version cache to grow)."""

    def __init__(self, registry: VersionRegistry) -> None:
        super().__init__({})
        self.registry = registry

    def model(self, version: int) -> torch.nn.Module:
        return self.registry[version]
