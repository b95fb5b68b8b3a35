"""Issue 37: the real deployment. One validator, three contributors and a remote trainer, each a
``prooftrain`` process started as the README's commands start them, on SQLite and on PostgreSQL.

It trains three versions, checks that contributors generated from versions above 0, stops
everything with SIGTERM, then audits the ledger offline and builds and verifies a release.
Small configuration: the tiny test model, one group per step, eight-token completions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ledger.records import AssignmentIssued, VerdictRecorded, decode_record
from ledger.storage import open_store
from node.validator.server import free_port, wait_healthy
from tests.ledger.conftest import pg_server  # noqa: F401  (fixture: a private PostgreSQL server)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cli(work: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )
    assert result.returncode == 0, f"{args}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _start(work: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "node.cli", *args],
        cwd=work,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return out


def _versions_generated(ledger: str) -> set[int]:
    """Policy versions of the assignments whose rollouts have a verdict."""
    store = open_store(ledger, readonly=True)
    try:
        issued, judged = {}, set()
        for _, _, data in store.entries():
            rec = decode_record(data)
            if isinstance(rec, AssignmentIssued):
                issued[rec.assignment_id] = rec.policy_version
            elif isinstance(rec, VerdictRecorded):
                judged.add(rec.assignment_id)
        return {issued[a] for a in judged if a in issued}
    finally:
        store.close()


@pytest.mark.parametrize(
    "store_kind",
    # about 40 s each; the README test runs this deployment over SQLite
    [pytest.param("sqlite", marks=pytest.mark.slow), "postgres"],
)
def test_validator_contributors_and_trainer_as_processes(
    store_kind: str, tmp_path: Path, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    work = tmp_path
    if store_kind == "postgres":
        ledger, blobs = request.getfixturevalue("pg_server").create_db(), "runs/validator/blobs"
    else:
        ledger, blobs = "runs/validator/ledger.sqlite", "runs/validator/ledger.sqlite.blobs"
    here = (
        ledger if store_kind == "postgres" else str(work / ledger)
    )  # the ledger, from this process
    for name in ("validator", "trainer", "c0", "c1", "c2"):
        _cli(work, "keys", "new", "--out", f"keys/{name}.key")
    (work / "validator.toml").write_text(
        f'[node]\nledger = "{ledger}"\ntrainer_key = "keys/trainer.key.pub"\nadmission_processes = 0\n'
        f'[policy]\nmodel_dir = "{tiny_model}"\n[task]\npool = 256\n'
        "[assignment]\ngroup_size = 4\nmax_tokens = 8\n[audit]\nqueue = 32\n"
    )
    _cli(work, "validator", "--config", "validator.toml", "--check")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = _start(
        work, "validator", "--config", "validator.toml", "--port", str(port), "--summary-s", "5"
    )
    contributors: list[subprocess.Popen] = []
    try:
        wait_healthy(port, node)
        contributors = [
            _start(
                work,
                "contributor",
                "--validator",
                url,
                "--key",
                f"keys/c{i}.key",
                "--model",
                str(tiny_model),
            )
            for i in range(3)
        ]
        _cli(
            work,
            "trainer",
            "--validator",
            url,
            "--trainer-key",
            "keys/trainer.key",
            "--model",
            str(tiny_model),
            "--steps",
            "3",
            "--quiet",
            "--checkpoint-dir",
            "runs/trainer",
            "--set",
            "batch_groups=1",
            "--set",
            "skip_uniform_groups=false",
            "--set",
            "eval_every=3",
            "--set",
            "eval_problems=4",
            "--set",
            "checkpoint_every=1",
        )
        deadline = time.monotonic() + 300
        while not _versions_generated(here) - {0} and time.monotonic() < deadline:
            time.sleep(1.0)
    finally:
        outputs = [_stop(c) for c in contributors]
        node_out = _stop(node)
    assert node.returncode == 0, node_out[-3000:]
    assert all("Traceback" not in out for out in outputs), outputs
    assert (
        len({p.name for p in (work / "runs" / "contributor").iterdir()}) == 3
    )  # one state dir per key
    assert _versions_generated(here) - {0}, "no contributor generated from a trained version"
    store = open_store(here, readonly=True)
    size, checkpoint = store.size(), store.latest_checkpoint()
    store.close()
    assert checkpoint is not None and checkpoint[0] == size  # the clean stop signed the last entry

    _cli(work, "audit", "verify", ledger, "--key", "keys/validator.key.pub", "--blobs", blobs)
    _cli(work, "audit", "prove", ledger, f"#{size - 1}", "--out", "last.proof")
    _cli(work, "audit", "check-proof", "last.proof", "--key", "keys/validator.key.pub")
    _cli(
        work,
        "release",
        "--ledger",
        ledger,
        "--out",
        "release",
        "--base-model",
        str(tiny_model),
        "--trainer-key",
        "keys/trainer.key",
        "--blobs",
        blobs,
        "--eval-problems",
        "4",
    )
    _cli(
        work,
        "release",
        "verify",
        "release",
        "--trainer-key",
        "keys/trainer.key.pub",
        "--validator-key",
        "keys/validator.key.pub",
    )
