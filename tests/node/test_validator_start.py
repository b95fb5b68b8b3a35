"""Issue 48, findings 3, 6 and 7: what a validator checks before it serves.

A tampered ledger is refused at start and by ``--check``, naming the entry; the last
verified checkpoint moves only with a start's check. A second node on the same ledger or
port stops before it writes anything.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from node.config import ValidatorConfig, load
from node.validator.build import build_validator
from node.validator.check import describe, verified_path
from node.validator.locks import hold
from node.validator.server import free_port

from .test_validator_process import ALICE, _cli, _env, _files, _key, _node_dir


def _ran_once(work: Path) -> ValidatorConfig:
    """The node's files after a run: a ledger with a registration and checkpoints."""
    cfg = load(ValidatorConfig, work / "validator.toml")
    v = build_validator(cfg, _key(work))
    v.register(ALICE.public.raw, "alice")
    v.ledger.checkpoint()
    v.ledger.close()
    v.state.close()
    return cfg


def _flip_body(ledger: Path, index: int) -> None:
    conn = sqlite3.connect(ledger, isolation_level=None)
    (body,) = conn.execute("SELECT body FROM entries WHERE idx = ?", (index,)).fetchone()
    changed = bytearray(body)
    changed[-1] ^= 0x01
    conn.execute("UPDATE entries SET body = ? WHERE idx = ?", (bytes(changed), index))
    conn.close()


def _size(ledger: Path) -> int:
    conn = sqlite3.connect(ledger)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0])
    finally:
        conn.close()


def test_a_tampered_ledger_is_refused_by_check_and_at_start(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _node_dir(tmp_path, tiny_model)
    monkeypatch.chdir(work)
    _ran_once(work)
    last = _size(work / "ledger.sqlite") - 1
    _flip_body(work / "ledger.sqlite", last)
    before = _files(work)
    check = _cli("validator", "--config", "validator.toml", "--check", cwd=work)
    assert check.returncode == 1
    assert f"the ledger fails verification at entry {last}:" in check.stderr
    assert "audit verify" in check.stderr and len(check.stderr.strip().splitlines()) == 1
    port = str(free_port())
    start = _cli("validator", "--config", "validator.toml", "--port", port, cwd=work)
    assert start.returncode == 1
    assert f"the ledger fails verification at entry {last}:" in start.stderr
    assert "Traceback" not in start.stderr
    after = {name: v for name, v in _files(work).items() if not name.endswith(".lock")}
    assert after == before  # no checkpoint signed over the damaged log


def test_the_full_pass_reads_what_the_last_verified_checkpoint_covers(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _node_dir(tmp_path, tiny_model)
    monkeypatch.chdir(work)
    cfg = _ran_once(work)
    describe(cfg, _key(work))  # a check changes nothing ...
    assert not verified_path(cfg).exists()
    lines = describe(cfg, _key(work), record=True)  # ... a start's check keeps its checkpoint
    assert verified_path(cfg).is_file()
    size = _size(work / "ledger.sqlite")
    assert f"ledger check  entries 0..{size - 1} verified (since-checkpoint)" in "\n".join(lines)
    _flip_body(work / "ledger.sqlite", 1)
    check = _cli("validator", "--config", "validator.toml", "--check", cwd=work)
    assert check.returncode == 0, check.stderr
    assert "no entry after the last verified checkpoint" in check.stdout
    full = _cli(
        "validator", "--config", "validator.toml", "--check", "--verify-ledger", "full", cwd=work
    )
    assert full.returncode == 1
    assert "the ledger fails verification at entry 1:" in full.stderr


def _start(work: Path, port: int, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", "validator", "--config", "validator.toml"]
        + ["--port", str(port)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def test_a_second_node_on_the_same_ledger_is_refused_before_writing(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _node_dir(tmp_path, tiny_model)
    monkeypatch.chdir(work)
    _ran_once(work)
    before = _files(work)
    with hold(work / "ledger.sqlite", "the ledger"):  # this process is the node running on it
        second = _start(work, free_port())
    assert second.returncode == 1
    assert f"is in use by process {os.getpid()}" in second.stderr
    assert "Traceback" not in second.stderr
    after = _files(work)
    assert after.pop("ledger.sqlite.lock") and before == after


def test_a_second_node_on_the_same_port_is_refused_before_opening_its_ledger(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _node_dir(tmp_path, tiny_model)
    monkeypatch.chdir(work)
    _ran_once(work)
    before = _files(work)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        second = _start(work, taken.getsockname()[1])
    assert second.returncode == 1
    assert "cannot listen on 127.0.0.1:" in second.stderr
    assert "Traceback" not in second.stderr
    assert _files(work) == before  # no final checkpoint written into the live ledger
