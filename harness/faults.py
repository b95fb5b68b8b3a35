"""Fault test of the validator node: SIGKILL it at random moments while contributors work.

The node runs as its own process (``prooftrain validator``) on 127.0.0.1;
contributor processes' logic (``node.contributor.Contributor``, which keeps
unacknowledged groups on disk and resubmits them) runs in threads. A killer
sends SIGKILL after a random delay, restarts the node, and repeats. At the end:

* the ledger passes ``audit verify`` after every kill;
* every verdict a contributor was told is in the ledger exactly as told;
* no rollout is recorded twice (restarts never double-admit a resubmission).

Prints one JSON object with the number of kills and the checks.

    python -m harness.faults [--kills 20] [--contributors 3]

The trainer's half (kill and resume ``prooftrain trainer``) is ``harness.trainer_faults``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from rollout.loading import model_dir_arg


def _start(work: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "validator",
            "--config",
            str(work / "validator.toml"),
            "--port",
            str(port),
        ],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from node.validator.server import free_port, wait_healthy
    from trainer.base_model import ensure_base_model

    rng = random.Random(args.seed)
    model = args.model or ensure_base_model("arithmetic", progress=False)
    told: list[tuple[bytes, bool]] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _write_node_config(work, model)
        port = free_port()
        node = _start(work, port)
        wait_healthy(port, node)
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=_contributor, args=(i, port, model, work, stop, told, lock), daemon=True
            )
            for i in range(args.contributors)
        ]
        for t in threads:
            t.start()
        node, audits_ok = _kill_and_restart(node, work, port, args.kills, rng, told)
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=60)
        final_ok, recorded, status = _read_ledger(work)
    mismatched = [d for d, ok in told if status.get(d) is not ok]
    doubled = [d for d, n in recorded.items() if n > 1]
    result = {
        "kills": args.kills,
        "audits_after_kills_ok": sum(audits_ok),
        "final_audit_ok": final_ok,
        "verdicts_told": len(told),
        "verdicts_recorded": sum(recorded.values()),
        "told_but_not_recorded_as_told": len(mismatched),
        "recorded_twice": len(doubled),
    }
    print(json.dumps(result))
    return 0 if all(audits_ok) and final_ok and not mismatched and not doubled and told else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--contributors", type=int, default=3)
    parser.add_argument(
        "--model", type=model_dir_arg, default=None, help="model dir (default: the demo base model)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _write_node_config(work: Path, model: Path) -> None:
    """The node's key and ``validator.toml`` in ``work`` (its ledger beside them)."""
    from verify.keys import SigningKey, save_signing_key

    save_signing_key(SigningKey.from_seed(b"\x41" * 32), work / "validator.key")
    (work / "validator.toml").write_text(
        f'[node]\nkey_file = "validator.key"\nledger = "ledger.sqlite"\ncheckpoint_every = 4\n'
        f'[policy]\nmodel_dir = "{model}"\n[assignment]\nmax_tokens = 8\n'
        f"[limits]\nrequests_per_s = 1000.0\nburst = 1000\n"
    )


def _contributor(
    i: int,
    port: int,
    model: Path,
    work: Path,
    stop: threading.Event,
    told: list[tuple[bytes, bool]],
    lock: threading.Lock,
) -> None:
    """Contributor ``i`` until ``stop``: each verdict it is told goes to ``told``; whenever the
    node goes away it starts over with a fresh client (its unacknowledged groups stay on disk)."""
    from node.client import ValidatorClient
    from node.contributor import Contributor
    from verify.keys import SigningKey

    key = SigningKey.from_seed(bytes([60 + i]) * 32)
    while not stop.is_set():
        try:
            client = ValidatorClient(f"http://127.0.0.1:{port}", key, retries=10, backoff=0.3)
            client.register(f"c{i}")
            worker = Contributor(client, key, model, work / f"c{i}", log=lambda _: None)
            while not stop.is_set():
                for v in worker.step():
                    with lock:
                        told.append((v.envelope_digest, v.accepted))
        except Exception as exc:  # noqa: BLE001 - the node is being killed on purpose
            if os.environ.get("PROOFTRAIN_FAULTS_VERBOSE"):
                print(f"contributor {i}: {exc!r}", file=sys.stderr)
            time.sleep(0.5)


def _kill_and_restart(
    node: subprocess.Popen,
    work: Path,
    port: int,
    kills: int,
    rng: random.Random,
    told: list[tuple[bytes, bool]],
) -> tuple[subprocess.Popen, list[bool]]:
    """SIGKILL the node ``kills`` times after random delays, auditing its ledger after each
    kill and restarting it; returns the running node and each audit's result."""
    from ledger.audit import verify_ledger
    from ledger.storage import open_store
    from node.validator.server import wait_healthy

    audits_ok = []
    for k in range(kills):
        time.sleep(rng.uniform(0.5, 4.0))
        node.send_signal(signal.SIGKILL)
        node.wait()
        store = open_store(str(work / "ledger.sqlite"), readonly=True)
        audits_ok.append(verify_ledger(store).ok)
        store.close()
        node = _start(work, port)
        wait_healthy(port, node)
        print(
            f"kill {k + 1}/{kills}: audit {'ok' if audits_ok[-1] else 'FAILED'}, "
            f"{len(told)} verdicts told",
            file=sys.stderr,
        )
    return node, audits_ok


def _read_ledger(work: Path) -> tuple[bool, Counter[bytes], dict[bytes, bool]]:
    """The stopped node's ledger: whether it passes ``audit verify``, how many verdicts it
    records per envelope digest, and the last verdict recorded for each."""
    from ledger.audit import verify_ledger
    from ledger.records import VerdictRecorded, decode_record
    from ledger.storage import open_store

    store = open_store(str(work / "ledger.sqlite"), readonly=True)
    final = verify_ledger(store)
    recorded: Counter[bytes] = Counter()
    status: dict[bytes, bool] = {}
    for _, _, body in store.entries(0, None):
        rec = decode_record(body)
        if isinstance(rec, VerdictRecorded):
            recorded[rec.envelope_digest] += 1
            status[rec.envelope_digest] = rec.accepted
    store.close()
    return final.ok, recorded, status


if __name__ == "__main__":
    sys.exit(main())
