"""Changing any single stored byte is detected by ``audit verify``, which names where."""

from __future__ import annotations

import random
import sqlite3
import struct
from pathlib import Path

from ledger.audit import verify_ledger
from ledger.log import Ledger
from ledger.storage import key_node, open_store
from verify.errors import Reason

from .conftest import ORIGIN, contributor, sample_records

TRIALS = 200


def build(open_ledger) -> Ledger:
    ledger = open_ledger()
    recs = sample_records(36, seed=7)
    ledger.append_many(recs[:12], checkpoint=True)
    ledger.append_many(recs[12:25], checkpoint=True)
    ledger.slash(contributor(1), Reason.SAMPLING_DISTRIBUTION, b"chi-square evidence", "p < 1e-9")
    ledger.append_many(recs[25:], checkpoint=True)
    return ledger


class Raw:
    """Direct SQL access to a store's tables, bypassing the ledger."""

    def __init__(self, url: str) -> None:
        self.pg = url.startswith("postgresql://")
        if self.pg:
            import psycopg

            self.conn = psycopg.connect(url, autocommit=True)
        else:
            self.conn = sqlite3.connect(url, isolation_level=None)

    def rows(self, sql: str) -> list:
        return self.conn.execute(sql).fetchall()

    def set(self, table: str, col: str, key_col: str, key, value) -> None:
        mark = "%s" if self.pg else "?"
        self.conn.execute(
            f"UPDATE {table} SET {col} = {mark} WHERE {key_col} = {mark}", (value, key)
        )

    def close(self) -> None:
        self.conn.close()


def cells(raw: Raw) -> list[tuple[str, str, str, object, object, str]]:
    """(table, column, key column, key, value, where the audit must point) for every stored value."""
    out = []
    for idx, leaf, body in raw.rows("SELECT idx, leaf, body FROM entries"):
        out.append(("entries", "leaf", "idx", idx, bytes(leaf), f"entry {idx}"))
        out.append(("entries", "body", "idx", idx, bytes(body), f"entry {idx}"))
    for key, h in raw.rows("SELECT id, hash FROM nodes"):
        level, index = key_node(key)
        out.append(("nodes", "hash", "id", key, bytes(h), f"node (level {level}, index {index})"))
    for size, note in raw.rows("SELECT size, note FROM checkpoints"):
        out.append(("checkpoints", "note", "size", size, note, f"checkpoint {size}"))
    for c, alpha, beta in raw.rows("SELECT contributor, alpha, beta FROM reputation"):
        where = f"reputation of {bytes(c).hex()}"
        out.append(("reputation", "alpha", "contributor", bytes(c), alpha, where))
        out.append(("reputation", "beta", "contributor", bytes(c), beta, where))
    return out


def flip(value, rng: random.Random):
    """``value`` with one byte changed (text stays valid UTF-8 without NUL; floats change one byte)."""
    if isinstance(value, float):
        raw = bytearray(struct.pack("<d", value))
        raw[rng.randrange(8)] ^= rng.randrange(1, 256)
        changed = struct.unpack("<d", bytes(raw))[0]
        return changed if changed == changed else value + 1.0  # NaN is not a stored float
    data = bytearray(value.encode() if isinstance(value, str) else value)
    while True:
        pos = rng.randrange(len(data))
        for mask in rng.sample(range(1, 256), 255):
            trial = bytearray(data)
            trial[pos] ^= mask
            if isinstance(value, bytes):
                return bytes(trial)
            try:
                text = bytes(trial).decode()
            except UnicodeDecodeError:
                continue
            if (
                "\x00" not in text
            ):  # PostgreSQL text columns cannot hold NUL, so no one can store it
                return text


def test_single_byte_tamper_is_detected_and_located(open_ledger, ledger_url) -> None:
    ledger = build(open_ledger)
    clean = verify_ledger(ledger.store, log_key=ledger.verifier, blobs=ledger.blobs)
    assert clean.ok, clean.findings
    raw = Raw(ledger_url)
    rng = random.Random(99)
    try:
        targets = cells(raw)
        weights = [len(v) if isinstance(v, bytes | str) else 8 for *_, v, _ in targets]
        for trial in range(TRIALS):
            table, col, key_col, key, value, where = rng.choices(targets, weights)[0]
            raw.set(table, col, key_col, key, flip(value, rng))
            try:
                report = verify_ledger(ledger.store, log_key=ledger.verifier, blobs=ledger.blobs)
            finally:
                raw.set(table, col, key_col, key, value)
            assert not report.ok, (trial, table, col, key)
            assert report.findings[0].where == where, (trial, where, str(report.findings[0]))
    finally:
        raw.close()
    assert verify_ledger(ledger.store, log_key=ledger.verifier).ok


# -- SQLite: bytes of the file itself


def _dump(path: Path) -> list:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.text_factory = bytes
    try:
        return [
            conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
            for t in ("entries", "nodes", "checkpoints", "reputation", "meta")
        ]
    finally:
        conn.close()


def _audit_file(data: bytes, path: Path, log_key):
    path.write_bytes(data)
    store = open_store(str(path), readonly=True)
    try:
        return verify_ledger(store, log_key=log_key)
    finally:
        store.close()
        for suffix in ("-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)


def _values(ledger: Ledger) -> list[tuple[bytes, str]]:
    """Every entry body, node hash and checkpoint note, with where the audit must point."""
    out = [(bytes(body), f"entry {idx}") for idx, _leaf, body in ledger.store.entries()]
    for level in range(1, ledger.size().bit_length()):
        for index, h in ledger.store.level(level):
            out.append((bytes(h), f"node (level {level}, index {index})"))
    out += [(note.encode(), f"checkpoint {size}") for size, note in ledger.store.checkpoints()]
    return out


def test_sqlite_file_bytes(tmp_path: Path, log_key) -> None:
    ledger = build(lambda: Ledger.open(tmp_path / "ledger.db", signing_key=log_key, origin=ORIGIN))
    path = Path(ledger.store.url)
    log_key = ledger.verifier
    values = _values(ledger)
    ledger.close()
    data = path.read_bytes()  # closing checkpointed the WAL into the file
    assert not Path(str(path) + "-wal").exists()
    targets = []
    for value, where in values:
        offset = data.index(value)
        assert data.find(value, offset + 1) < 0, where  # stored exactly once
        targets.append((offset, len(value), where))
    work = tmp_path / "work.db"
    assert _audit_file(data, work, log_key).ok
    rng = random.Random(7)
    weights = [length for _, length, _ in targets]
    for trial in range(TRIALS):
        offset, length, where = rng.choices(targets, weights)[0]
        pos = offset + rng.randrange(length)
        tampered = bytearray(data)
        tampered[pos] ^= rng.randrange(1, 256)
        report = _audit_file(bytes(tampered), work, log_key)
        assert not report.ok, (trial, pos, where)
        assert report.findings[0].where == where, (trial, pos, where, str(report.findings[0]))
    # Any byte at all: either the audit fails, or the bytes were unused (same logical content).
    baseline = _dump(_copy(data, tmp_path / "base.db"))
    detected = 0
    for trial in range(TRIALS):
        pos = rng.randrange(len(data))
        tampered = bytearray(data)
        tampered[pos] ^= rng.randrange(1, 256)
        report = _audit_file(bytes(tampered), work, log_key)
        if report.ok:
            assert _dump(_copy(bytes(tampered), tmp_path / "same.db")) == baseline, (trial, pos)
        else:
            detected += 1
    assert detected > 0


def _copy(data: bytes, path: Path) -> Path:
    path.write_bytes(data)
    return path
