"""Issue 48, finding 3: a node verifies its ledger before it appends to it.

The default pass trusts the last verified checkpoint and checks what came after it; the
full pass checks everything. A changed byte after that checkpoint is caught by both, one at
or before it by the full pass.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ledger.log import Ledger
from ledger.note import Verifier
from ledger.start_check import LedgerCheckError, verify_full, verify_since
from ledger.storage import open_store
from verify.keys import SigningKey

from .conftest import ORIGIN, sample_records
from .test_tamper import Raw

KEY = SigningKey.from_seed(b"\x11" * 32)
LOG = Verifier(ORIGIN, 0x01, KEY.public)


def _ledger(path: Path | str, seed: int = 3) -> list[str]:
    """A ledger with checkpoints at 13, 26 and 40 entries; their notes."""
    recs = sample_records(36, seed=seed)
    with Ledger.open(path, signing_key=KEY, origin=ORIGIN) as ledger:
        ledger.append_many(recs[:12], checkpoint=True)
        ledger.append_many(recs[12:25], checkpoint=True)
        ledger.append_many(recs[25:], checkpoint=True)
        return [text for _, text in ledger.store.checkpoints()]


def _flip_body(url: Path | str, index: int) -> None:
    raw = Raw(str(url))
    try:
        ((body,),) = raw.rows(f"SELECT body FROM entries WHERE idx = {index}")
        changed = bytearray(body)
        changed[len(changed) // 2] ^= 0x01
        raw.set("entries", "body", "idx", index, bytes(changed))
    finally:
        raw.close()


def _since(store, since):  # noqa: ANN001, ANN202
    return verify_since(store, LOG, since)


def test_an_intact_ledger_verifies_from_the_start_and_from_each_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite"
    notes = _ledger(path)
    store = open_store(str(path), readonly=True)
    try:
        whole = _since(store, None)
        assert (whole.size, whole.first, whole.checkpoint) == (40, 0, notes[-1])
        assert _since(store, notes[0]).first == 13
        assert _since(store, notes[-1]).first == 40
        assert verify_full(store, LOG).checkpoint == notes[-1]
    finally:
        store.close()


def test_a_changed_entry_after_the_verified_checkpoint_is_named(ledger_url: str) -> None:
    notes = _ledger(ledger_url)
    _flip_body(ledger_url, 20)
    store = open_store(ledger_url, readonly=True)
    try:
        for since in (None, notes[0]):
            with pytest.raises(LedgerCheckError) as err:
                _since(store, since)
            assert err.value.where == "entry 20"
        # At or before the verified checkpoint: only the full pass reads it again.
        assert _since(store, notes[1]).size == 40
        with pytest.raises(LedgerCheckError) as err:
            verify_full(store, LOG)
        assert err.value.where == "entry 20"
    finally:
        store.close()


def test_a_verified_checkpoint_must_be_the_logs_and_match_its_tree(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    notes = _ledger(path)
    other = _ledger(tmp_path / "other.sqlite", seed=4)
    store = open_store(str(path), readonly=True)
    try:
        forged = notes[0].replace("\n13\n", "\n12\n", 1)  # the signature no longer matches
        assert forged != notes[0]
        with pytest.raises(LedgerCheckError, match="last verified checkpoint"):
            _since(store, forged)
        with pytest.raises(LedgerCheckError, match="no longer folds to its signed root"):
            _since(store, other[1])  # same key and sizes, other entries
    finally:
        store.close()


def test_a_changed_node_or_checkpoint_after_the_verified_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    notes = _ledger(path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("UPDATE checkpoints SET note = ? WHERE size = 40", (notes[1],))
    conn.close()
    store = open_store(str(path), readonly=True)
    try:
        with pytest.raises(LedgerCheckError) as err:
            _since(store, notes[0])
        assert err.value.where == "checkpoint 40"
    finally:
        store.close()
