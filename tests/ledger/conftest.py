"""Fixtures: every storage test runs on SQLite and on a private PostgreSQL server.

The PostgreSQL server is started once per session from Debian's binaries
(``initdb`` + ``pg_ctl``) in a temporary directory, listening only on
127.0.0.1 on a free port, and stopped at the end. Each test gets a fresh
database. Without the binaries the postgres cases are skipped, except when
``CI`` is set: then they fail, so CI cannot skip them silently.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.log import Ledger
from ledger.records import ContributorRegistered, Slashed, VerdictRecorded, evidence_digest
from verify.errors import Reason
from verify.keys import SigningKey

ORIGIN = "prooftrain.test/ledger"


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="prooftrain-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres", "postgres")

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off -c max_connections=50"
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "log"),
            "-o",
            opts,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        try:
            self._run(
                str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"
            )
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def create_db(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn(name)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries (initdb) are missing and CI is set")
        pytest.skip("PostgreSQL server binaries (initdb) are not installed")
    server = PgServer(bindir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def ledger_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return str(tmp_path / "ledger.db")
    server: PgServer = request.getfixturevalue("pg_server")
    return server.create_db()


@pytest.fixture
def log_key() -> SigningKey:
    return SigningKey.from_seed(bytes(range(32)))


@pytest.fixture
def open_ledger(ledger_url: str, log_key: SigningKey, tmp_path: Path):
    opened: list[Ledger] = []

    def _open(**kw) -> Ledger:
        kw.setdefault("signing_key", log_key)
        kw.setdefault("origin", ORIGIN)
        kw.setdefault("blobs", tmp_path / "blobs")
        ledger = Ledger.open(ledger_url, **kw)
        opened.append(ledger)
        return ledger

    yield _open
    for ledger in opened:
        ledger.close()


def contributor(i: int) -> bytes:
    return bytes([i + 1]) * 32


def sample_records(n: int, seed: int = 0, contributors: int = 3) -> list:
    """A deterministic mix of registrations, audited/unaudited verdicts and slashes."""
    recs: list = [ContributorRegistered(contributor(c), f"c{c}", c) for c in range(contributors)]
    for i in range(n):
        c = contributor((i + seed) % contributors)
        tag = (i * 7 + seed) % 11
        env = (i + seed * 100_003).to_bytes(32, "big")
        if tag == 10:
            ev = f"evidence {i} {seed}".encode()
            recs.append(
                Slashed(c, Reason.LOGPROB_MISMATCH.value, f"slash {i}", evidence_digest(ev), ev, i)
            )
        elif tag in (8, 9):
            recs.append(
                VerdictRecorded(
                    c,
                    i.to_bytes(16, "big"),
                    i % 4,
                    env,
                    False,
                    Reason.LOGPROB_MISMATCH.value,
                    True,
                    evidence_digest(env),
                    i,
                )
            )
        else:
            recs.append(
                VerdictRecorded(c, i.to_bytes(16, "big"), i % 4, env, True, "", tag < 5, b"", i)
            )
    return recs
