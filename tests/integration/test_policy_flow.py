"""Trainer -> validator -> contributor: a new policy version travels as signed compressed deltas.

The trainer publishes version 1 to a live validator over HTTP; the contributor
process rebuilds it from the manifest chain and generates under it; the
validator spot-checks those rollouts under its own rebuild of version 1 and
accepts them. A crash between generation and acknowledgement never causes a
second submission.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ledger.log import Ledger
from node.client import ValidatorClient
from node.config import ValidatorConfig, load
from node.contributor import Contributor
from node.validator.build import policy_loader
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from node.validator.state import StateStore
from rewards.tasks.base import generate
from rollout.backends import TransformersBackend, register_backend
from rollout.loading import load_pretrained_lm
from rollout.oracle import TransformersOracle
from trainer.publish import StagePublisher, publish_version, publishable_state
from verify.keys import SigningKey
from verify.spotcheck import FLOAT32_TOLERANCE

TRAINER = SigningKey.from_seed(b"\x71" * 32)
VALIDATOR = SigningKey.from_seed(b"\x72" * 32)
ALICE = SigningKey.from_seed(b"\x73" * 32)


@register_backend("test-directory-only")
class DirectoryOnlyBackend(TransformersBackend):
    """A backend that, like vLLM's, loads only from a model directory."""

    loads_from_directory = True
    loaded: list[str] = []

    def __init__(self, model: str, **kwargs: object) -> None:
        assert isinstance(model, str) and Path(model, "config.json").is_file(), model
        DirectoryOnlyBackend.loaded.append(model)
        super().__init__(model, **kwargs)  # type: ignore[arg-type]


def _validator(tmp: Path, model: Path) -> Validator:
    cfg = load(
        ValidatorConfig,
        None,
        {"assignment.max_tokens": 10, "rules.audit_rate": 1.0, "audit.pit_min_tokens": 100_000},
    )
    ledger = Ledger.open(tmp / "ledger.sqlite", signing_key=VALIDATOR, origin="test")
    state = StateStore(tmp / "state.sqlite")
    oracle = TransformersOracle(policy_loader(model, TRAINER.public, state, ledger))
    return Validator(
        cfg,
        VALIDATOR,
        ledger,
        state,
        HFTextCodec(model),
        oracle,
        generate("arithmetic", "train", 64),
        PolicyVersions(model_dir_digest(model), TRAINER.public),
        FLOAT32_TOLERANCE,
    )


@pytest.mark.parametrize("backend", ["transformers", "test-directory-only"])
def test_published_version_is_rebuilt_generated_and_verified(
    tmp_path: Path, tiny_model: Path, backend: str
) -> None:
    v = _validator(tmp_path, tiny_model)
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        alice = ValidatorClient(url, ALICE)
        alice.register("alice")
        worker = Contributor(
            alice, ALICE, tiny_model, tmp_path / "alice", log=lambda _: None, backend=backend
        )
        assert all(x.accepted for x in worker.step())

        # The trainer takes a step and publishes version 1 as an int8 delta.
        model = load_pretrained_lm(tiny_model, dtype=torch.float32)  # a node is running beside
        publisher = StagePublisher(0, publishable_state(model), "int8-block")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        trainer = ValidatorClient(url, TRAINER)
        sealed = publish_version(
            [publisher],
            [publishable_state(model)],
            trainer,
            parent=None,
            base_digest=model_dir_digest(tiny_model),
            trainer_key=TRAINER,
            now_ms=int(time.time() * 1000),
        )
        assert v.versions.current == 1 and trainer.manifest(1) == sealed

        verdicts = worker.step()  # assigned version 1: rebuilt from the delta, then generated
        assert all(x.accepted and x.audited for x in verdicts)
        assert worker._version == 1
        rebuilt = dict(worker._sync.state_at(1))
        for name, value in publisher.published_state().items():
            assert torch.equal(rebuilt[name], value), name
        if backend == "test-directory-only":  # version 1 went through a written directory
            written = Path(DirectoryOnlyBackend.loaded[-1])
            assert written == tmp_path / "alice" / "policy" / "v1"
            assert sorted(p.name for p in written.parent.iterdir()) == ["v1"]


def test_restart_resubmits_instead_of_regenerating(tmp_path: Path, tiny_model: Path) -> None:
    v = _validator(tmp_path, tiny_model)
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        client = ValidatorClient(url, ALICE)
        client.register("alice")
        worker = Contributor(client, ALICE, tiny_model, tmp_path / "alice", log=lambda _: None)
        real_submit = client.submit

        def crash(raw: bytes):  # type: ignore[no-untyped-def]
            real_submit(raw)  # the validator got it, the acknowledgement is lost
            raise KeyboardInterrupt

        client.submit = crash  # type: ignore[method-assign]
        try:
            worker.step()
        except KeyboardInterrupt:
            pass
        size = v.ledger.size()
        client.submit = real_submit  # type: ignore[method-assign]
        again = Contributor(client, ALICE, tiny_model, tmp_path / "alice", log=lambda _: None)
        verdicts = again.step()
        assert all(x.accepted for x in verdicts)
        assert v.ledger.size() == size  # the same group, answered from the stored verdicts
