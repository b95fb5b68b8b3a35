"""Kill one pipeline stage process mid-step: torchrun restarts the stages, the run resumes from
its last checkpoint, and the ledger shows one consistent version history with no sample
consumed twice (S = 2, gloo on CPU, ``--max-restarts``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.trainer_faults import check_run, published_versions, tiny_config
from ledger.storage import storage_errors
from trainer.base_model import ensure_base_model
from trainer.loop import checkpoint_version

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def _stages(root: int) -> dict[tuple[int, int], int]:
    """(rank, restart count) -> pid of every stage process under ``root``."""
    children, found, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env = dict(
                kv.split("=", 1)
                for kv in (Path("/proc") / str(pid) / "environ").read_text().split("\0")
                if "=" in kv
            )
        except OSError:
            continue
        if "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
            found[(int(env["RANK"]), int(env["TORCHELASTIC_RESTART_COUNT"]))] = pid
    return found


def _run_and_kill(
    tmp_path: Path, checkpoint_every: int, due: Callable[[Path], bool]
) -> tuple[int, int]:
    """Run S = 2 with ``--max-restarts 2``; SIGKILL rank 1 once ``due(checkpoint_dir)``.

    Returns the newest published version and the newest checkpoint at the kill.
    """
    model = ensure_base_model("arithmetic", progress=False)
    ckpt = tmp_path / "ckpt"
    (tmp_path / "t.toml").write_text(
        tiny_config(model, ckpt, STEPS, stages=2, checkpoint_every=checkpoint_every)
    )
    log = open(tmp_path / "trainer.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "trainer",
            "--config",
            str(tmp_path / "t.toml"),
            "--max-restarts",
            "2",
            "--quiet",
            "--metrics",
            str(tmp_path / "metrics.jsonl"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not due(ckpt):
            assert proc.poll() is None and time.monotonic() < deadline, "not due in time"
            time.sleep(0.005)
        os.kill(_stages(proc.pid)[(1, 0)], signal.SIGKILL)  # a stage, not the torchrun agent
        head, saved = _head(ckpt), checkpoint_version(ckpt)
        restarts = set()
        while proc.poll() is None:
            assert time.monotonic() < deadline + 300, "the run did not finish"
            restarts |= {n for (_, n) in _stages(proc.pid)}
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    out = (tmp_path / "trainer.log").read_text()
    assert proc.returncode == 0, out[-3000:]
    assert 1 in restarts, "torchrun did not restart the stages"
    figures, problems = check_run(ckpt, model, STEPS, ranks=2)
    assert problems == [], (problems, out[-3000:])
    assert figures["versions_published"] == STEPS and figures["steps_journaled"] == STEPS
    assert figures["samples_trained"] > 0
    return head, saved


def _head(ckpt: Path) -> int:
    """The newest published version (rank 0 may still be writing to the ledger)."""
    ledger = ckpt / "network" / "ledger.sqlite"
    for _ in range(50):
        try:
            return len(published_versions(ledger)) if ledger.is_file() else 0
        except storage_errors():
            time.sleep(0.05)
    return len(published_versions(ledger))


def _metrics_version(ckpt: Path) -> int:
    """The newest version rank 0 logged (it logs a version after publishing it)."""
    path = ckpt.parent / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((json.loads(x)["version"] for x in lines if x.endswith("}")), default=0)


@pytest.mark.slow
def test_killing_a_stage_mid_step_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    """Checkpoint every step; the kill lands in step 4 (after checkpoint 3, before version 4)."""
    head, saved = _run_and_kill(tmp_path, 1, lambda ckpt: checkpoint_version(ckpt) >= 3)
    assert head == saved == 3


@pytest.mark.slow
def test_killing_a_stage_after_an_unsaved_publication_re_runs_it(tmp_path: Path) -> None:
    """Checkpoint every 2 steps; the kill lands after version 3 is published, before checkpoint 4:
    the restart resumes from checkpoint 2 and re-runs step 3 without announcing it again."""
    head, saved = _run_and_kill(tmp_path, 2, lambda ckpt: _metrics_version(ckpt) >= 3)
    assert head == 3 and saved == 2
