"""Smoke tests of ``prooftrain audit`` as a subprocess."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

from ledger.log import Ledger
from ledger.merkle import leaf_hash
from ledger.records import VerdictRecorded
from verify.errors import Reason
from verify.keys import SigningKey

from .conftest import ORIGIN, contributor, sample_records


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", "audit", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_audit_cli(tmp_path) -> None:
    path = tmp_path / "ledger.db"
    key = SigningKey.from_seed(b"\x04" * 32)
    with Ledger.open(path, signing_key=key, origin=ORIGIN) as ledger:
        records = sample_records(30)
        ledger.append_many(records, checkpoint=True)
        for rec in records:  # each failed verdict's evidence (its envelope digest here) is in
            if isinstance(rec, VerdictRecorded) and rec.evidence_digest:  # the blob store
                ledger.blobs.put(rec.envelope_digest)  # type: ignore[union-attr]
        ledger.slash(contributor(2), Reason.LOGPROB_MISMATCH, b"x" * 5000, "big evidence")
        ledger.checkpoint()
        vkey = ledger.verifier.vkey()
        body = ledger.store.entry(12)[1]

    ok = cli("verify", str(path), "--key", vkey)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok: 35 entries, 2 checkpoints")

    who = cli("contributor", str(path), contributor(2).hex())
    assert who.returncode == 0, who.stderr
    assert "BANNED" in who.stdout and "slash #34 [logprob_mismatch] big evidence" in who.stdout
    assert "(blob, verified, 5000 bytes)" in who.stdout

    proof_file = tmp_path / "entry.tlog-proof"
    made = cli("prove", str(path), leaf_hash(body).hex(), "--out", str(proof_file))
    assert made.returncode == 0, made.stderr
    assert proof_file.read_text().startswith("c2sp.org/tlog-proof@v1\nextra ")
    checked = cli("check-proof", str(proof_file), "--key", vkey)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["index"] == 12
    by_hex = cli("check-proof", str(proof_file), "--key", key.public.hex())
    assert by_hex.returncode == 0, by_hex.stderr
    wrong = cli(
        "check-proof", str(proof_file), "--key", SigningKey.from_seed(b"\x05" * 32).public.hex()
    )
    assert wrong.returncode == 1 and wrong.stderr.startswith("error:")

    conn = sqlite3.connect(path)
    conn.execute("UPDATE entries SET body = ? WHERE idx = 12", (body[:-1] + bytes([body[-1] ^ 1]),))
    conn.commit()
    conn.close()
    bad = cli("verify", str(path), "--key", vkey)
    assert bad.returncode == 1
    assert bad.stdout.startswith("FAILED: first discrepancy at entry 12:")
