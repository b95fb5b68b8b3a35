"""A live validator core over a tiny random model, for node tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness.tiny_model import build_tiny_model
from ledger.log import Ledger
from node.config import ValidatorConfig, load
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import StateStore
from rewards.tasks.base import generate
from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle
from verify.keys import SigningKey
from verify.spotcheck import FLOAT32_TOLERANCE


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("other-model"), seed=1)


@pytest.fixture(scope="session")
def codec(tiny_model: Path) -> HFTextCodec:
    return HFTextCodec(tiny_model)


@pytest.fixture(scope="session")
def backend(tiny_model: Path) -> TransformersBackend:
    return TransformersBackend(tiny_model)


ValidatorFactory = Callable[..., Validator]


@pytest.fixture
def make_validator(tmp_path: Path, tiny_model: Path, codec: HFTextCodec) -> ValidatorFactory:
    made: list[Validator] = []

    def make(
        overrides: dict | None = None,
        key: SigningKey | None = None,
        pool: int = 64,
        name: str = "v",
        *,
        problems=None,
        clock=None,
        tolerance=FLOAT32_TOLERANCE,
        oracle=None,
    ) -> Validator:
        base = {
            "assignment.max_tokens": 12,
            "assignment.group_size": 4,
            "rules.audit_rate": 1.0,
            "audit.pit_min_tokens": 100_000,
        }
        cfg = load(ValidatorConfig, None, {**base, **(overrides or {})})
        key = key or SigningKey.from_seed(b"\x05" * 32)
        ledger = Ledger.open(tmp_path / f"{name}.sqlite", signing_key=key, origin="test/validator")
        state = StateStore(tmp_path / f"{name}.state.sqlite")
        oracle = oracle or TransformersOracle({0: tiny_model})
        versions = PolicyVersions(model_dir_digest(tiny_model))
        extra = {} if clock is None else {"clock": clock}
        v = Validator(
            cfg,
            key,
            ledger,
            state,
            codec,
            oracle,
            problems or generate("arithmetic", "train", pool),
            versions,
            tolerance,
            **extra,
        )
        made.append(v)
        return v

    yield make
    for v in made:
        v.ledger.close()
        v.state.close()
