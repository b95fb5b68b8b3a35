"""Issue 37, finding 3: a validator node on a PostgreSQL ledger is complete. It stores blobs
(policy updates, evals) in its configured blob directory and its state where
``node.state_file`` says, never in the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.client import ValidatorClient
from node.config import ValidatorConfig, load
from node.validator.build import build_validator
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from tests.ledger.conftest import PgServer
from tests.node.conftest import tiny_model  # noqa: F401  (fixture)
from verify.keys import SigningKey

KEY = SigningKey.from_seed(b"\x05" * 32)
TRAINER = SigningKey.from_seed(b"\x0c" * 32)


def test_a_postgres_node_stores_blobs_and_state_where_configured(
    pg_server: PgServer,
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load(
        ValidatorConfig,
        None,
        {
            "node.ledger": pg_server.create_db(),
            "node.trainer_key": TRAINER.public.hex(),
            "node.state_file": str(tmp_path / "state" / "node.state"),
            "node.blob_dir": str(tmp_path / "blobs"),
            "policy.model_dir": str(tiny_model),
            "task.pool": 16,
            "node.admission_processes": 0,
        },
    )
    v = build_validator(cfg, KEY)
    try:
        with BackgroundServer(create_app(v, TRAINER.public)) as url:
            client = ValidatorClient(url, TRAINER)
            digest = client.put_blob(b"a policy update")
            assert client.blob(digest) == b"a policy update"
            client.close()
    finally:
        v.ledger.close()
        v.state.close()
    assert (tmp_path / "state" / "node.state").is_file()
    assert (tmp_path / "blobs" / digest.hex()[:2] / digest.hex()).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs", "state"]  # nothing in the cwd


def test_postgres_defaults_are_documented_paths() -> None:
    cfg = load(ValidatorConfig, None, {"node.ledger": "postgresql://u@h/db"})
    assert cfg.node.state_path() == Path("runs/validator/node.state")
    assert cfg.node.blob_path() == Path("runs/validator/blobs")
    sqlite = load(ValidatorConfig, None, {})
    assert sqlite.node.state_path() == Path("runs/validator/ledger.sqlite.state")
    assert sqlite.node.blob_path() == Path("runs/validator/ledger.sqlite.blobs")
