"""tlog-checkpoint parsing, witnesses, and the tlog-proof@v1 format."""

from __future__ import annotations

import base64

import pytest

from ledger.audit import verify_ledger
from ledger.checkpoint import (
    Checkpoint,
    TlogProof,
    Witness,
    check_proof,
    open_checkpoint,
    sign_checkpoint,
)
from ledger.log import Ledger
from ledger.merkle import EMPTY_ROOT
from ledger.note import ALG_COSIGNATURE_V1, Signer
from verify.errors import DecodeError, LedgerError, ProofError, SignatureError, VerificationError
from verify.keys import SigningKey

from .conftest import ORIGIN, sample_records

ROOT_B64 = base64.b64encode(b"\x07" * 32).decode()


def test_checkpoint_text_round_trip() -> None:
    cp = Checkpoint("example.com/log", 12345, b"\x07" * 32, ("ext one",))
    assert cp.text() == f"example.com/log\n12345\n{ROOT_B64}\next one\n"
    assert Checkpoint.from_text(cp.text()) == cp


@pytest.mark.parametrize(
    "text",
    [
        f"example.com/log\n012\n{ROOT_B64}\n",  # leading zero
        f"example.com/log\n-1\n{ROOT_B64}\n",
        f"example.com/log\n12\n{ROOT_B64}",  # no final newline
        "example.com/log\n12\nAAAA\n",  # root too short
        f"\n12\n{ROOT_B64}\n",  # empty origin
        f"example.com/log\n12\n{ROOT_B64}\n\n",  # empty extension line
        f"example.com/log\n12\n{ROOT_B64[:-2]}x=\n",  # not canonical base64
    ],
)
def test_bad_checkpoint_text(text: str) -> None:
    with pytest.raises(DecodeError):
        Checkpoint.from_text(text)


def _ledger(tmp_path, name="l.db", key=None) -> Ledger:
    return Ledger.open(
        tmp_path / name, signing_key=key or SigningKey.from_seed(b"\x01" * 32), origin=ORIGIN
    )


def test_witness_cosigns_consistent_checkpoints(tmp_path) -> None:
    ledger = _ledger(tmp_path)
    wkey = SigningKey.from_seed(b"\x02" * 32)
    witness = Witness(Signer("witness.example/w", wkey, ALG_COSIGNATURE_V1), ledger.verifier)
    ledger.append_many(sample_records(10), checkpoint=True)
    ledger.cosign(witness, timestamp=1_000)
    ledger.append_many(sample_records(7, seed=1), checkpoint=True)
    signed = ledger.cosign(witness, timestamp=2_000)
    wv = witness.signer.verifier
    opened = open_checkpoint(signed.to_text(), ledger.verifier, [wv], quorum=1)
    assert opened.checkpoint.size == ledger.size()
    with pytest.raises(VerificationError):
        open_checkpoint(signed.to_text(), ledger.verifier, [], quorum=1)
    # A fork signed by the same log key, inconsistent with what the witness saw, is refused.
    fork = _ledger(tmp_path, "fork.db", SigningKey.from_seed(b"\x01" * 32))
    fork.append_many(sample_records(30, seed=9), checkpoint=True)
    latest = fork.latest_checkpoint()
    proof = fork.consistency_proof(signed.checkpoint.size, latest.checkpoint.size)
    with pytest.raises(LedgerError):
        witness.cosign(latest.to_text(), proof, 3_000)
    older = sign_checkpoint(Checkpoint(ORIGIN, 3, EMPTY_ROOT), ledger._signer)
    with pytest.raises(LedgerError):
        witness.cosign(older.to_text(), [], 3_000)
    # A witness signature that fails breaks the note for anyone who trusts that witness.
    line = next(x for x in signed.to_text().splitlines() if x.startswith("— witness.example/w "))
    sig = base64.b64decode(line.split(" ")[2])
    forged = (
        line.split(" ")[0]
        + " witness.example/w "
        + base64.b64encode(sig[:-1] + bytes([sig[-1] ^ 1])).decode()
    )
    bad = signed.to_text().replace(line, forged)
    with pytest.raises(VerificationError):
        open_checkpoint(bad, ledger.verifier, [wv], quorum=1)
    assert verify_ledger(ledger.store, log_key=ledger.verifier, witnesses=[wv]).ok
    with ledger.store.write() as tx:
        tx.put_checkpoint(signed.checkpoint.size, bad)
    report = verify_ledger(ledger.store, log_key=ledger.verifier, witnesses=[wv])
    assert report.findings[0].where == f"checkpoint {signed.checkpoint.size}"


def test_tlog_proof_format(tmp_path) -> None:
    ledger = _ledger(tmp_path)
    ledger.append_many(sample_records(20), checkpoint=True)
    proof = ledger.prove(7)
    text = proof.to_text()
    lines = text.split("\n")
    assert lines[0] == "c2sp.org/tlog-proof@v1"
    assert lines[1].startswith("extra ") and lines[2] == "index 7"
    assert text.endswith(ledger.latest_checkpoint().to_text())
    parsed = TlogProof.from_text(text)
    assert parsed == proof
    check_proof(parsed, ledger.verifier)
    with pytest.raises(ProofError):
        check_proof(TlogProof.from_text(text.replace("index 7", "index 8")), ledger.verifier)
    with pytest.raises(DecodeError):
        TlogProof.from_text(text.replace("index 7", "index 07"))
    with pytest.raises(DecodeError):
        TlogProof.from_text("garbage\n" + text)
    with pytest.raises(ProofError):  # a proof hash dropped
        hash_line = lines[3]
        check_proof(TlogProof.from_text(text.replace(hash_line + "\n", "", 1)), ledger.verifier)
    other = Signer(ORIGIN, SigningKey.from_seed(b"\x03" * 32)).verifier
    with pytest.raises(SignatureError):
        check_proof(parsed, other)
    swapped = TlogProof(7, parsed.hashes, parsed.checkpoint, parsed.extra + b"\x00")
    with pytest.raises(ProofError):
        check_proof(swapped, ledger.verifier)


def test_single_entry_tree_proof(tmp_path) -> None:
    ledger = _ledger(tmp_path)
    ledger.checkpoint()
    proof = ledger.prove(0)
    assert proof.hashes == ()
    check_proof(TlogProof.from_text(proof.to_text()), ledger.verifier)
