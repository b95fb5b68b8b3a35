"""Issue 37, findings 4-6: the validator as an operator runs it, in a process of its own.

``--check`` reads everything and writes nothing; SIGTERM drains admissions and signs a
final checkpoint; the node logs its events and ``/metrics`` agrees with ``/healthz``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from node.config import ValidatorConfig
from verify.keys import SigningKey

ROOT = Path(__file__).resolve().parents[2]
TRAINER = SigningKey.from_seed(b"\x0c" * 32)
ALICE = SigningKey.from_seed(b"\x0a" * 32)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _node_dir(tmp_path: Path, tiny_model: Path) -> Path:
    work = tmp_path / "node"
    work.mkdir()
    assert _cli("keys", "new", "--out", "keys/validator.key", cwd=work).returncode == 0
    (work / "trainer.pub").write_text(TRAINER.public.hex() + "\n")
    row = {
        "token_abs": 0.01,
        "chunk_mean_abs": 0.001,
        "replay_slack": 0.002,
        "logprob_scale": 1e-3,
        "logprob_null": 0.125,
        "replay_scale": 0.002,
        "replay_null": 0.01,
        "observed_token_max": 1e-5,
        "observed_chunk_mean_max": 1e-6,
        "observed_replay_gap_max": 0.0,
        "observed_token_mean_abs": 1e-6,
        "observed_replay_gap_mean": 0.0,
        "min_setting_tokens": 2_000,
    }  # what `prooftrain calibrate` writes for one precision
    tolerance = {"by_precision": {"float32": row}}
    (work / "tolerance.json").write_text(json.dumps(tolerance))
    (work / "validator.toml").write_text(
        f'[node]\nledger = "ledger.sqlite"\ntrainer_key = "trainer.pub"\nadmission_processes = 0\n'
        f'[policy]\nmodel_dir = "{tiny_model}"\n[task]\npool = 64\n'
        f'[assignment]\nmax_tokens = 8\n[audit]\ntolerance_file = "tolerance.json"\n'
    )
    return work


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and modification time; SQLite's -wal and -shm files, which a reader of a
    WAL database opens (empty) and which hold no data of their own, left out."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith(("-wal", "-shm"))
    }


def test_the_shipped_config_lists_every_setting() -> None:
    text = (ROOT / "configs" / "validator.toml").read_text()
    tomllib.loads(text)  # and it parses
    for name, section in ValidatorConfig.model_fields.items():
        block = re.search(rf"^\[{name}\]\n(.*?)(?=^\[|\Z)", text, flags=re.M | re.S)
        assert block, f"[{name}] is missing"
        for field in section.annotation.model_fields:  # type: ignore[union-attr]
            assert re.search(rf"^#? ?{field} = ", block.group(1), flags=re.M), (
                f"{name}.{field} is missing"
            )


def test_check_prints_what_it_read_and_changes_nothing(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _node_dir(tmp_path, tiny_model)
    monkeypatch.chdir(work)
    # A node that ran once: the ledger exists, with entries and a checkpoint.
    from node.config import load
    from node.validator.build import build_validator

    v = build_validator(load(ValidatorConfig, work / "validator.toml"), _key(work))
    v.ledger.close()
    v.state.close()
    before = _files(work)
    for _ in range(2):
        result = _cli("validator", "--config", "validator.toml", "--check", cwd=work)
        assert result.returncode == 0, result.stderr
    assert _files(work) == before
    assert "tolerance     tolerance.json (float32: token 0.01" in result.stdout
    assert f"trainer key   {TRAINER.public.hex()} (trainer.pub)" in result.stdout
    assert "ledger        ledger.sqlite (" in result.stdout


def test_check_on_a_fresh_node_creates_nothing(tmp_path: Path, tiny_model: Path) -> None:
    work = _node_dir(tmp_path, tiny_model)
    before = _files(work)
    result = _cli("validator", "--config", "validator.toml", "--check", cwd=work)
    assert result.returncode == 0, result.stderr
    assert "not created yet" in result.stdout
    assert _files(work) == before


def _key(work: Path) -> SigningKey:
    from verify.keys import load_signing_key

    return load_signing_key(work / "keys" / "validator.key", None)


def test_sigterm_signs_a_final_checkpoint_and_the_node_logs_and_counts(
    tmp_path: Path, tiny_model: Path
) -> None:
    from ledger.storage import open_store
    from node.client import ServiceError, ValidatorClient
    from node.validator.server import free_port, wait_healthy

    work = _node_dir(tmp_path, tiny_model)
    port = free_port()
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "validator",
            "--config",
            "validator.toml",
            "--port",
            str(port),
            "--log-format",
            "json",
            "--summary-s",
            "1",
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        wait_healthy(port, node)
        client = ValidatorClient(f"http://127.0.0.1:{port}", ALICE)
        client.register("alice")  # appended after the start-up checkpoint
        client.assign()
        with pytest.raises(ServiceError):
            client.manifest(7)  # a 404
        health = httpx.get(f"http://127.0.0.1:{port}/healthz").json()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        client.close()
    finally:
        node.send_signal(signal.SIGTERM)
        out, err = node.communicate(timeout=60)
    assert node.returncode == 0, err
    assert f"prooftrain_ledger_size {float(health['ledger_size'])}" in metrics
    assert 'prooftrain_http_requests_total{endpoint="/v1/register",status="200"} 1.0' in metrics
    assert 'prooftrain_http_requests_total{endpoint="/v1/policy",status="404"} 1.0' in metrics
    assert "prooftrain_policy_version 0.0" in metrics
    assert "prooftrain_reputation_banned 0.0" in metrics
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    kinds = [e.get("event") for e in events]
    assert "registration" in kinds and "admission" in kinds and kinds[-1] == "stop"
    assert ALICE.public.hex() not in err  # fingerprints, never keys
    assert "final checkpoint covers all" in out
    store = open_store(str(work / "ledger.sqlite"), readonly=True)
    try:
        size, _ = store.latest_checkpoint()  # type: ignore[misc]
        assert size == store.size() >= health["ledger_size"]
    finally:
        store.close()
