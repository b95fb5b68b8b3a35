"""Smoke tests of ``prooftrain audit`` as a subprocess."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

from ledger.log import Ledger
from ledger.merkle import leaf_hash
from ledger.records import ContributorRegistered, VerdictRecorded
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


def test_audit_contributor_prints_a_summary_first_and_entries_on_request(tmp_path) -> None:
    path = tmp_path / "ledger.db"
    c = contributor(0)

    def verdict(i: int, accepted: bool, reason: str, audited: bool) -> VerdictRecorded:
        env = i.to_bytes(32, "big")
        evidence = b"" if accepted else env
        return VerdictRecorded(
            c, i.to_bytes(16, "big"), 0, env, accepted, reason, audited, evidence, i
        )

    verdicts = [
        verdict(1, True, "", True),
        verdict(2, True, "", False),
        verdict(3, True, "", False),
        verdict(4, False, Reason.LOGPROB_MISMATCH.value, True),
        verdict(5, False, Reason.LOGPROB_MISMATCH.value, True),
        verdict(6, False, Reason.GROUP_REJECTED.value, False),
    ]
    with Ledger.open(path, signing_key=SigningKey.from_seed(b"\x04" * 32), origin=ORIGIN) as ledger:
        ledger.append_many([ContributorRegistered(c, "c0", 0), *verdicts], checkpoint=True)
        ledger.slash(c, Reason.LOGPROB_MISMATCH, b"evidence", "logprob 3.1 vs 2.0")
        ledger.checkpoint()

    who = cli("contributor", str(path), c.hex())
    assert who.returncode == 0, who.stderr
    lines = who.stdout.splitlines()
    assert lines[0].startswith(f"contributor {c.hex()}: BANNED, score ")
    assert lines[2:6] == [
        "  verdicts 6: accepted 3, rejected 3 (logprob_mismatch 2, group_rejected 1)",
        "  audited 3 (rejected 2 of them)",
        "  slashes 1 (logprob_mismatch 1)",
        "  8 ledger entries: contributor_registered 1, slash 1, verdict 6",
    ]
    assert "  (--history lists all 8 entries)" in lines
    assert not any(line.startswith("  #") for line in lines)  # no entry without --history
    assert "slash #8 [logprob_mismatch] logprob 3.1 vs 2.0" in who.stdout

    full = cli("contributor", str(path), c.hex(), "--history")
    assert full.returncode == 0, full.stderr
    assert full.stdout.splitlines()[:6] == lines[:6]
    assert sum(line.startswith("  #") for line in full.stdout.splitlines()) == 8

    doc = json.loads(cli("contributor", str(path), c.hex(), "--json").stdout)
    assert doc["summary"]["rejected_by_reason"] == {"logprob_mismatch": 2, "group_rejected": 1}
    assert len(doc["history"]) == 8
