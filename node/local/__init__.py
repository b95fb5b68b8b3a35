"""The in-process network: what ``prooftrain trainer`` trains against without ``--validator``.

- :mod:`node.local.network`: one validator core with its ledger, N honest
  contributors and the published policy versions, all in this process;
- :mod:`node.local.versions`: the published versions in memory and the
  spot-check oracle over them;
- :mod:`node.local.train`: a one-stage or pipelined training run against it.

The harness builds its simulations on the same network (``harness.run``) and
adds adversarial contributors to it (``harness.local``).
"""

from node.local.network import (
    LocalNetwork,
    LocalSettings,
    Stats,
    local_trainer_key,
    local_validator_key,
    simulation_entropy,
)
from node.local.train import BroadcastSource, run_local, run_local_pipeline, settings_from
from node.local.versions import RegistryOracle, VersionRegistry

__all__ = [
    "BroadcastSource",
    "LocalNetwork",
    "LocalSettings",
    "RegistryOracle",
    "Stats",
    "VersionRegistry",
    "local_trainer_key",
    "local_validator_key",
    "run_local",
    "run_local_pipeline",
    "settings_from",
    "simulation_entropy",
]
