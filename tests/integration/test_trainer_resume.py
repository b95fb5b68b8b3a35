"""Issue 48: training goes on after the README's trainer run, with and without its checkpoint.

Validator, three contributors and a remote trainer, each a ``prooftrain`` process as the
README starts them (the trainer with its default checkpoint directory):

1. the trainer trains versions 1..3 and exits; everything stops;
2. everything starts again; the trainer continues from its checkpoint to version 5;
3. everything stops, the checkpoint directory is removed, everything starts again; the
   trainer rebuilds version 5 from the validator's chain of signed updates (the published
   copy it had checkpointed, bit for bit), trains on, and SIGTERM stops it with one line
   after a checkpoint.

Every version is published once, in order, and the ledger audits.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from ledger.records import PolicyPublished, decode_record
from ledger.storage import open_store
from node.validator.server import free_port, wait_healthy
from tests.integration.test_deployment import _cli, _start, _stop
from tests.ledger.conftest import pg_server  # noqa: F401  (fixture: a private PostgreSQL server)

CHECKPOINTS = Path("runs/trainer/checkpoints")  # the trainer's default against a validator
TRAINER_SETS = (
    "batch_groups=1",
    "skip_uniform_groups=false",
    "eval_every=0",
)


@contextmanager
def _network(work: Path, port: int, model: Path) -> Iterator[str]:
    """The validator and three contributors, stopped (contributors first) on exit."""
    node = _start(work, "validator", "--config", "validator.toml", "--port", str(port))
    contributors: list[subprocess.Popen] = []
    try:
        wait_healthy(port, node)
        url = f"http://127.0.0.1:{port}"
        args = ("--validator", url, "--model", str(model))
        contributors = [
            _start(work, "contributor", *args, "--key", f"keys/c{i}.key") for i in range(3)
        ]
        yield url
    finally:
        outputs = [_stop(c) for c in contributors]
        node_out = _stop(node)
    assert node.returncode == 0, node_out[-3000:]
    assert all("Traceback" not in out for out in outputs), outputs


def _trainer(work: Path, url: str, model: Path, steps: int) -> list[str]:
    args = ["trainer", "--validator", url, "--trainer-key", "keys/trainer.key"]
    args += ["--model", str(model), "--steps", str(steps), "--quiet"]
    for item in TRAINER_SETS:
        args += ["--set", item]
    return args


def _published(ledger: str) -> list[int]:
    store = open_store(ledger, readonly=True)
    try:
        return [
            rec.version
            for _, _, data in store.entries()
            if isinstance(rec := decode_record(data), PolicyPublished)
        ]
    finally:
        store.close()


def _checkpoint(work: Path, version: int) -> dict:
    path = work / CHECKPOINTS / f"v{version:08d}" / "stage0.pt"
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize(
    "store_kind",
    [
        # 80 to 95 s each, so both run in make test-all. make test covers the parts:
        # tests/integration/test_remote_trainer.py (a trainer killed between publication
        # and checkpoint resumes and publishes on), tests/harness/test_trainer_faults.py
        # (trainer processes killed at random resume to one consistent history),
        # tests/trainer/test_chain_resume.py (the chain's rebuilt weights are the
        # publisher's copy bit for bit), tests/node/test_remote_resume.py (where a trainer
        # starts) and tests/integration/test_deployment.py[postgres] (the processes over
        # one PostgreSQL ledger).
        pytest.param("sqlite", marks=pytest.mark.slow),
        pytest.param("postgres", marks=pytest.mark.slow),
    ],
)
def test_trainer_continues_after_a_restart_from_its_checkpoint_or_the_chain(
    store_kind: str, tmp_path: Path, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    work = tmp_path
    if store_kind == "postgres":
        ledger = here = request.getfixturevalue("pg_server").create_db()
        blobs = "runs/validator/blobs"
    else:
        ledger, blobs = "runs/validator/ledger.sqlite", "runs/validator/ledger.sqlite.blobs"
        here = str(work / ledger)
    for name in ("validator", "trainer", "c0", "c1", "c2"):
        _cli(work, "keys", "new", "--out", f"keys/{name}.key")
    (work / "validator.toml").write_text(
        f'[node]\nledger = "{ledger}"\ntrainer_key = "keys/trainer.key.pub"\n'
        f'admission_processes = 0\nblob_dir = "{blobs}"\n'
        f'[policy]\nmodel_dir = "{tiny_model}"\n[task]\npool = 256\n'
        "[assignment]\ngroup_size = 4\nmax_tokens = 8\n[audit]\nqueue = 32\n"
    )
    port = free_port()

    # 1. A plain run writes checkpoints to the default directory.
    with _network(work, port, tiny_model) as url:
        _cli(work, *_trainer(work, url, tiny_model, 3))
    assert (work / CHECKPOINTS / "latest").read_text() == "v00000003"

    # 2. Started again, it continues from its checkpoint (no --resume needed).
    with _network(work, port, tiny_model) as url:
        second = _cli(work, *_trainer(work, url, tiny_model, 5))
    assert "resumed at policy version 3 from the checkpoint" in second.stderr, second.stderr
    assert _published(here) == [1, 2, 3, 4, 5]
    kept = _checkpoint(work, 5)

    # 3. Without the checkpoint directory it rebuilds version 5 from the validator's chain.
    shutil.rmtree(work / CHECKPOINTS)
    with _network(work, port, tiny_model) as url:
        trainer = _start(work, *_trainer(work, url, tiny_model, 1000))
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and trainer.poll() is None:
                if httpx.get(f"{url}/healthz", timeout=5).json()["policy_version"] >= 7:
                    break
                time.sleep(0.5)
            trainer.send_signal(signal.SIGTERM)
            out, _ = trainer.communicate(timeout=120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    assert trainer.returncode == 0, out[-3000:]
    assert "rebuilt policy version 5 from the validator's chain" in out, out[-3000:]
    assert "fresh optimizer moments" in out
    assert "Traceback" not in out
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1, out[-3000:]
    last = int((work / CHECKPOINTS / "latest").read_text().removeprefix("v"))
    assert f"at policy version {last};" in stopped[0]
    assert last >= 7
    published = _published(here)
    assert published == list(range(1, len(published) + 1)) and published[-1] >= last

    # The chain's weights are the published copy the trainer had checkpointed, bit for bit
    # (the codec is lossy: the trainer's own float32 weights are not in the chain).
    rebuilt = _checkpoint(work, 5)
    assert rebuilt["version"] == 5
    own, again = kept["publish"]["publisher"]["own"], rebuilt["publish"]["publisher"]["own"]
    assert own.keys() == again.keys()
    for name, value in own.items():
        assert torch.equal(value, again[name]), name
        assert torch.equal(rebuilt["stage"][name], value), name
    assert rebuilt["optimizer"]["state"] == {}  # fresh moments

    _cli(work, "audit", "verify", ledger, "--key", "keys/validator.key.pub", "--blobs", blobs)
