"""Remote mode: trainer, validator node and contributor as three parties over loopback HTTP.

The trainer pulls accepted samples by cursor, publishes each version as a
signed int8 delta, evaluates the published copy and records the eval in the
ledger; a contributor process keeps generating, following the new versions
from the manifest chain, and the validator spot-checks every rollout under
its own rebuild of the version it assigned.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ledger.audit import verify_ledger
from ledger.records import EvalRecorded, PolicyPublished, VerdictRecorded
from node.client import ServiceError, ValidatorClient
from node.contributor import Contributor
from node.remote_trainer import run_remote
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from rollout.sync import PolicySync
from tests.integration.test_policy_flow import ALICE, TRAINER, _validator
from trainer.buffer import StarvedError
from trainer.config import load_trainer_config


def _config(model: Path, tmp: Path, **extra):  # type: ignore[no-untyped-def]
    return load_trainer_config(
        None,
        {
            "model_dir": str(model),
            "steps": 3,
            "batch_groups": 1,
            "eval_every": 2,
            "eval_problems": 8,
            "skip_uniform_groups": False,
            "checkpoint_dir": str(tmp / "ckpt"),
            "checkpoint_every": 1,
            "local.group_size": 8,
            "local.temperature": 1.0,
            "buffer_capacity": 64,
            "starve_timeout_s": 120.0,
            **extra,
        },
    )


@contextlib.contextmanager
def _contributing(
    url: str, model: Path, state_dir: Path
) -> Iterator[tuple[Contributor, list[int]]]:
    """A contributor generating in a background thread; yields it and the versions it served."""
    alice = ValidatorClient(url, ALICE)
    alice.register("alice")
    worker = Contributor(alice, ALICE, model, state_dir, log=lambda _: None)
    stop = threading.Event()
    seen: list[int] = []

    def contribute() -> None:
        while not stop.is_set():
            try:
                worker.step()
            except ServiceError as exc:  # e.g. the key holds its share of this version's prompts
                assert exc.busy, exc
                stop.wait(0.05)
                continue
            seen.append(worker._version)

    thread = threading.Thread(target=contribute, daemon=True)
    thread.start()
    try:
        yield worker, seen
    finally:
        stop.set()
        thread.join(60)


def test_remote_trainer_publishes_versions_contributors_follow(
    tmp_path: Path, tiny_model: Path
) -> None:
    torch.set_num_threads(1)
    v = _validator(tmp_path, tiny_model)
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        with _contributing(url, tiny_model, tmp_path / "alice") as (worker, seen):
            history = run_remote(
                _config(tiny_model, tmp_path), url, TRAINER, progress=False, poll_s=0.05
            )
            deadline = time.monotonic() + 60
            while max(seen, default=0) < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
        assert v.versions.current == 3
        records = [r for _, r in v.ledger.entries()]
        published = [r.version for r in records if isinstance(r, PolicyPublished)]
        assert published == [1, 2, 3]
        assert [r.version for r in records if isinstance(r, EvalRecorded)] == [0, 2, 3]
        assert set(history.evals) == {0, 2, 3}
        verdicts = [r for r in records if isinstance(r, VerdictRecorded)]
        assert verdicts and all(r.accepted for r in verdicts)
        assert max(seen) == 3  # the contributor followed the published chain
        assert verify_ledger(v.ledger.store, blobs=v.ledger.blobs).ok

        # Anyone rebuilds version 3 from what the validator serves; it equals the
        # contributor's rebuild bit for bit.
        client = ValidatorClient(url, ALICE)
        sync = PolicySync(tiny_model, TRAINER.public, client.manifest, client.blob, 1)
        for name, value in sync.state_at(3).items():
            assert torch.equal(value, worker._sync.state_at(3)[name]), name

        # A trainer without a checkpoint of this run rebuilds version 3 from the validator's
        # chain: the published copy contributors hold, bit for bit, and continues from there.
        other = tmp_path / "other"
        assert run_remote(_config(tiny_model, other), url, TRAINER, progress=False).metrics == []
        saved = torch.load(other / "ckpt" / "v00000003" / "stage0.pt", weights_only=False)
        rebuilt = sync.state_at(3)
        for name, value in saved["publish"]["publisher"]["own"].items():
            assert torch.equal(value, rebuilt[name]), name
        for name, value in saved["stage"].items():
            if name in rebuilt:
                assert torch.equal(value, rebuilt[name]), name
        assert saved["buffer"]["held"] == []
        assert saved["buffer"]["cursor"] == 1 + max(
            i for i, r in v.ledger.entries() if isinstance(r, PolicyPublished)
        )


def test_trainer_cli_in_remote_mode(tmp_path: Path, tiny_model: Path) -> None:
    import json
    import subprocess
    import sys

    from verify.keys import save_signing_key

    key_file = tmp_path / "trainer.key"
    save_signing_key(TRAINER, key_file)
    config = tmp_path / "trainer.toml"
    config.write_text("[trainer]\n")
    v = _validator(tmp_path, tiny_model)
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        sets = {
            "model_dir": str(tiny_model),
            "batch_groups": 1,
            "eval_every": 0,
            "eval_problems": 4,
            "skip_uniform_groups": False,
            "local.temperature": 1.0,
            "buffer_capacity": 64,
        }
        with _contributing(url, tiny_model, tmp_path / "alice"):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "node.cli",
                    "trainer",
                    "--config",
                    str(config),
                    "--validator",
                    url,
                    "--trainer-key",
                    str(key_file),
                    "--steps",
                    "1",
                    "--quiet",
                    "--checkpoint-dir",
                    str(tmp_path / "ckpt"),
                    *[a for k, val in sets.items() for a in ("--set", f"{k}={json.dumps(val)}")],
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
        assert done.returncode == 0, done.stderr[-2000:]
        assert v.versions.current == 1
        assert "pass@1" in done.stdout


def test_failed_starts_record_the_base_eval_once(tmp_path: Path, tiny_model: Path) -> None:
    """Issue 37: each trainer start that failed (here: no samples come) had recorded another
    version-0 eval. The validator's ledger says which versions are evaluated; a new start skips them."""
    v = _validator(tmp_path, tiny_model)
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        assert ValidatorClient(url, TRAINER).recorded_evals() == []
        for attempt in range(2):
            cfg = _config(
                tiny_model,
                tmp_path / str(attempt),
                eval_every=1,
                eval_problems=2,
                starve_timeout_s=0.2,
            )
            with pytest.raises(StarvedError):
                run_remote(cfg, url, TRAINER, progress=False, poll_s=0.05)
        assert ValidatorClient(url, TRAINER).recorded_evals() == [0]
    evals = [r.version for _, r in v.ledger.entries() if isinstance(r, EvalRecorded)]
    assert evals == [0]


def test_a_kill_between_publication_and_checkpoint_resumes_and_publishes_on(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The checkpoint is one version behind the validator (killed after publishing 3): the
    journaled step 3 is re-run without publishing it, the published copy is the validator's
    version 3, and the next start publishes 4 on top of it."""
    torch.set_num_threads(1)
    v = _validator(tmp_path, tiny_model)
    ckpt = tmp_path / "ckpt"
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        with _contributing(url, tiny_model, tmp_path / "alice"):
            run_remote(_config(tiny_model, tmp_path), url, TRAINER, progress=False, poll_s=0.05)
            (ckpt / "latest").write_text("v00000002")  # checkpoint 3 never happened
            shutil.rmtree(ckpt / "v00000003")
            cfg = _config(tiny_model, tmp_path, steps=4)
            run_remote(cfg, url, TRAINER, progress=False, poll_s=0.05)
        assert v.versions.current == 4
        published = [r.version for _, r in v.ledger.entries() if isinstance(r, PolicyPublished)]
        assert published == [1, 2, 3, 4]
        saved = torch.load(ckpt / "v00000004" / "stage0.pt", weights_only=False)
        client = ValidatorClient(url, ALICE)
        sync = PolicySync(tiny_model, TRAINER.public, client.manifest, client.blob, 1)
        for name, value in saved["publish"]["publisher"]["own"].items():
            assert torch.equal(value, sync.state_at(4)[name]), name


def test_the_trainer_waits_out_a_validator_whose_disk_is_full(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A full disk on the validator refuses the trainer's writes with 503 storage_full. The
    trainer says what to do and sends the same request again until it is taken: the blob
    upload of version 1 is refused twice and the ledger entry of version 2 once, and every
    version is still published once, in order."""
    import errno

    torch.set_num_threads(1)
    v = _validator(tmp_path, tiny_model)
    refusals = {"blob": 2, "policy": 1}
    real_put, real_append = v.ledger.blobs.put, v.ledger.append_many

    def put(data: bytes) -> bytes:
        if refusals["blob"]:
            refusals["blob"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(data)

    def append_many(records, **kw):  # type: ignore[no-untyped-def]
        if refusals["policy"] and any(
            isinstance(r, PolicyPublished) and r.version == 2 for r in records
        ):
            refusals["policy"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(records, **kw)

    monkeypatch.setattr(v.ledger.blobs, "put", put)
    monkeypatch.setattr(v.ledger, "append_many", append_many)
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        with _contributing(url, tiny_model, tmp_path / "alice"):
            cfg = _config(tiny_model, tmp_path, eval_every=0)
            run_remote(cfg, url, TRAINER, progress=False, poll_s=0.05, patience_s=0.05)
    assert refusals == {"blob": 0, "policy": 0}
    published = [r.version for _, r in v.ledger.entries() if isinstance(r, PolicyPublished)]
    assert published == [1, 2, 3]
    assert verify_ledger(v.ledger.store, blobs=v.ledger.blobs).ok
    told = [line for line in capsys.readouterr().err.splitlines() if "storage_full" in line]
    assert told and "free space on the validator's disk" in told[0]


def test_sigterm_ends_the_trainers_wait_for_an_unreachable_validator(tmp_path: Path) -> None:
    """Started before its validator (or while it restarts), the trainer waits and says so;
    SIGTERM ends the wait cleanly, naming how to continue."""
    import signal
    import socket
    import subprocess
    import sys

    from verify.keys import save_signing_key

    key_file = tmp_path / "trainer.key"
    save_signing_key(TRAINER, key_file)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "trainer", "--validator", f"http://127.0.0.1:{port}"]
        + ["--trainer-key", str(key_file), "--quiet", "--checkpoint-dir", str(tmp_path / "c")],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stderr is not None
        lines = []
        while not any("is the validator running" in line for line in lines):
            line = trainer.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert f"cannot reach the validator at http://127.0.0.1:{port}/v1/info" in lines[-1]
        trainer.send_signal(signal.SIGTERM)
        rest = trainer.communicate(timeout=60)[1]
    finally:
        trainer.kill()
    assert trainer.returncode == 0, rest
    assert "stopped by SIGTERM while waiting for the validator" in rest
    assert "continues from the validator's policy version" in rest
