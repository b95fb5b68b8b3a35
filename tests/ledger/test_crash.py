"""A writer killed with SIGKILL at random moments never leaves a log that fails to verify,
and never loses an append that returned success."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

from ledger.audit import verify_ledger
from ledger.log import Ledger
from ledger.merkle import leaf_hash
from ledger.records import canonical_bytes
from ledger.storage import open_store
from verify.keys import SigningKey

from .conftest import ORIGIN, sample_records

TRIALS = 20


def _writer(url: str, seed: int, conn) -> None:  # runs in the forked child
    rng = random.Random(seed)
    ledger = Ledger.open(url, signing_key=SigningKey.from_seed(bytes(range(32))))
    conn.send(("ready",))
    batch = 0
    while True:
        recs = sample_records(rng.randint(1, 60), seed=seed * 1000 + batch)
        idx = ledger.append_many(recs, checkpoint=rng.random() < 0.3)
        digest = hashlib.sha256(b"".join(leaf_hash(canonical_bytes(r)) for r in recs)).hexdigest()
        conn.send((idx.start, idx.stop, digest))
        if rng.random() < 0.1:
            ledger.checkpoint()
        batch += 1


def test_sigkill_never_corrupts(ledger_url: str, log_key: SigningKey) -> None:
    Ledger.open(ledger_url, signing_key=log_key, origin=ORIGIN).close()
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(1234)
    committed: list[tuple[int, int, str]] = []
    for trial in range(TRIALS):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_writer, args=(ledger_url, trial + 1, child), daemon=True)
        proc.start()
        child.close()
        assert parent.recv() == ("ready",)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        while True:
            try:
                committed.append(parent.recv())
            except EOFError:
                break
        parent.close()
        store = open_store(ledger_url, readonly=True)
        try:
            report = verify_ledger(store)
            assert report.ok, (trial, [str(f) for f in report.findings[:5]])
            leaves = [bytes(leaf) for _, leaf, _ in store.entries()]
            for start, stop, digest in committed:
                assert stop <= len(leaves), (trial, start, stop)
                got = hashlib.sha256(b"".join(leaves[start:stop])).hexdigest()
                assert got == digest, (trial, start, stop)
        finally:
            store.close()
    assert len(committed) >= TRIALS  # the writer did get appends through
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "audit", "verify", ledger_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:")
