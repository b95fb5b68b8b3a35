"""The harness's in-process network: adversarial contributors beside the honest ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.local import AdversarialNetwork
from tests.node.conftest import build_tiny_model
from tests.node.test_local_network import small
from verify.errors import ConfigError, Reason

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("local-tiny"), seed=5)


def test_cheating_contributor_is_caught(tiny: Path) -> None:
    net = AdversarialNetwork(
        tiny, small(contributors=1, adversaries=("tampered-logprobs",), groups_per_fetch=4)
    )
    try:
        batch = net.fetch(0, 1000)
        cheater = net.contributors[1][0].public.raw
        assert batch.samples and all(s.contributor_key != cheater for s in batch.samples)
        assert net.stats.verdicts[Reason.LOGPROB_MISMATCH.value] > 0
        assert set(net.stats.verdicts) <= {
            "accepted",
            Reason.LOGPROB_MISMATCH.value,
            Reason.GROUP_REJECTED.value,
        }
    finally:
        net.close()


def test_an_unknown_strategy_is_refused_by_name(tiny: Path) -> None:
    with pytest.raises(ConfigError, match="no-such-strategy"):
        AdversarialNetwork(tiny, small(adversaries=("no-such-strategy",)))
