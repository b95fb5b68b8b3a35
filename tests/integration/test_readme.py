"""Every command block of the README runs, in a tiny configuration, so the docs cannot rot.

Blocks run in order in a scratch directory holding a copy of ``configs/``;
``.venv/bin/prooftrain`` is this interpreter's ``-m node.cli``. What the
tiny configuration changes, and nothing else:

* the base model is the cached demo build copied into ``runs/base-model``
  (the build command then reports it cached instead of training again);
* the scenarios are replaced by a two-step, three-contributor scenario (the
  real-model ones by a one-step run of three SmolLM2 contributors, one of them
  generating with an int8 copy, on 8-token completions of their own task);
* the validator the README starts listens on a free 127.0.0.1 port instead of
  8470, with eight-token completions, no precheck worker and a deeper audit
  queue; ``configs/trainer.toml`` keeps all-equal-reward groups and evaluates
  on four problems, and the trainer against the validator runs three steps of
  one group each (as ``tests/integration/test_deployment.py``); placeholders
  (``CONTRIBUTOR_KEY_HEX``, ``VALIDATOR_KEY_HEX``) get the keys made by the
  earlier blocks;
* the quickstart (``make demo``, ``make test``) is what CI itself runs and is
  not run again from inside the suite;
* the campaigns run with short bounds (``--seconds 5``, one kill each: their own tests
  in ``tests/harness/`` kill more);
* on the real model, the validator (``configs/validator_smollm2.toml``) listens on
  another free port instead of 8472 and assigns 8-token completions from a pool
  of 32 problems, calibration uses one prompt of 8 tokens in float32, and the eval
  two problems of 8 tokens;
* ``$PROOFTRAIN_PG_DSN`` is a fresh database on the suite's private PostgreSQL
  server (``pg_server`` of ``tests/ledger/conftest.py``), and the second node the
  PostgreSQL section starts listens on another free port instead of 8471. Without
  the server binaries that section is skipped (with a warning) where the other
  PostgreSQL tests skip: only when ``CI`` is not set.

Background processes run as a shell runs them: a command ending in `` &`` is
started and left running, ``kill $(jobs -p)`` sends SIGTERM to every one still
running, and ``wait`` waits for them all: each must exit with 0, or by that SIGTERM,
and print no traceback; ``kill $!`` and ``wait $!`` do the same for the last one
started only, ``NAME=$(jobs -p | tail -n N)`` names the last N started, and
``kill $NAME`` and ``wait $NAME`` do the same for those. ``> FILE`` at the end of a
command writes its output to FILE.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import IO

import pytest

from tests.ledger.conftest import _pg_bin, pg_server  # noqa: F401  (fixture: a private PostgreSQL server)

ROOT = Path(__file__).resolve().parents[2]
TINY_SCENARIO = """
name = "{name}"
[task]
train_pool = 128
heldout = 16
[[population.groups]]
strategy = "honest"
count = 2
[[population.groups]]
strategy = "greedy"
count = 1
[validator]
group_size = 4
max_tokens = 8
[trainer]
steps = 2
batch_groups = 2
eval_every = 2
eval_problems = 16
[baselines]
run_honest_baseline = false
run_no_defence = false
"""
REAL_SCENARIOS = {"smollm2_gsm8k": "gsm8k", "smollm2_addition": "addition"}
"""The real-model scenarios, each replaced by ``TINY_REAL_SCENARIO`` on its own task."""
TINY_REAL_SCENARIO = """
name = "smollm2_gsm8k"
[task]
name = "gsm8k"
train_pool = 16
heldout = 2
[model]
pretrained = "smollm2-135m"
[[population.groups]]
strategy = "honest"
count = 2
[[population.groups]]
strategy = "low-precision-copy"
count = 1
params = { dtype = "int8" }
[validator]
group_size = 2
max_tokens = 8
[trainer]
steps = 1
batch_groups = 1
eval_every = 1
eval_problems = 2
skip_uniform_groups = false
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def readme_blocks() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        commands = body.replace("\\\n", " ").strip().splitlines()
        blocks.append([c.strip() for c in commands if c.strip() and not c.strip().startswith("#")])
    return blocks


def test_readme_blocks_are_found() -> None:
    blocks = readme_blocks()
    assert blocks[0] == ["make demo", "make test"]
    assert len(blocks) >= 6


def _set(text: str, section: str, key: str, value: str) -> str:
    """``text`` (TOML) with ``key = value`` in ``[section]``, replacing any line setting it."""
    head = f"[{section}]\n"
    start = text.index(head) + len(head)
    end = text.find("\n[", start)
    end = len(text) if end < 0 else end + 1
    body = re.sub(rf"^#? ?{key} = .*\n", "", text[start:end], flags=re.M)
    return text[:start] + f"{key} = {value}\n" + body + text[end:]


def _prepare(work: Path, port: int, real_port: int) -> None:
    from trainer.base_model import ensure_base_model

    shutil.copytree(ROOT / "configs", work / "configs")
    for scenario in (work / "configs" / "scenarios").glob("*.toml"):
        task = REAL_SCENARIOS.get(scenario.stem)
        scenario.write_text(
            TINY_REAL_SCENARIO.replace("smollm2_gsm8k", scenario.stem).replace(
                'name = "gsm8k"', f'name = "{task}"'
            )
            if task
            else TINY_SCENARIO.format(name=scenario.stem)
        )
    node = (work / "configs" / "validator.toml").read_text()
    for section, key, value in (
        ("node", "port", str(port)),
        ("node", "admission_processes", "0"),
        ("assignment", "max_tokens", "8"),
        ("audit", "queue", "32"),
    ):
        node = _set(node, section, key, value)
    (work / "configs" / "validator.toml").write_text(node)
    real = (work / "configs" / "validator_smollm2.toml").read_text()
    for section, key, value in (
        ("node", "port", str(real_port)),
        ("node", "admission_processes", "0"),
        ("task", "pool", "32"),
        ("assignment", "max_tokens", "8"),
        ("audit", "queue", "32"),
        ("audit", "min_calibration_tokens", "8"),
    ):
        real = _set(real, section, key, value)
    (work / "configs" / "validator_smollm2.toml").write_text(real)
    trainer = (work / "configs" / "trainer.toml").read_text()
    for key, value in (("skip_uniform_groups", "false"), ("eval_problems", "4")):
        trainer = _set(trainer, "trainer", key, value)
    (work / "configs" / "trainer.toml").write_text(trainer)
    shutil.copytree(ensure_base_model("arithmetic", progress=False), work / "runs" / "base-model")


SHORTER = {"--seconds 30": "--seconds 5", "--kills 5": "--kills 1", "--groups 5": "--groups 2"}
SMALLER = {"--steps 10": "--steps 3", "batch_groups=4": "batch_groups=1"}  # the remote trainer
REAL_MODEL = {
    "-n 20 -k 1": "-n 2 -k 1 --max-new-tokens 8",
    "--prompts 16 --max-tokens 128": "--prompts 1 --max-tokens 8 --batch-sizes 1 "
    "--generation-dtypes float32 --backends transformers --min-tokens 8",
}


class Jobs:
    """The background processes of the README's shell (`` &``), each logging to a file."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.running: list[tuple[str, subprocess.Popen, IO[str]]] = []
        self.killed: set[int] = set()
        self.named: dict[str, set[int]] = {}
        """``NAME=$(jobs -p | tail -n N)``: NAME -> the process ids of the last N jobs."""

    def name(self, name: str, last: int) -> None:
        self.named[name] = {proc.pid for _, proc, _ in self.running[-last:]}

    def _chosen(self, last: bool, name: str | None) -> list[tuple[str, subprocess.Popen, IO[str]]]:
        if name is not None:
            return [job for job in self.running if job[1].pid in self.named[name]]
        return self.running[-1:] if last else list(self.running)

    def start(self, cmd: str, argv: list[str]) -> None:
        log = open(self.work / f"job{len(self.running)}.log", "w+")  # noqa: SIM115  (closed in wait)
        proc = subprocess.Popen(
            argv, cwd=self.work, stdout=log, stderr=subprocess.STDOUT, text=True, env=_env()
        )
        self.running.append((cmd, proc, log))

    def kill(self, last: bool = False, name: str | None = None) -> None:
        """SIGTERM to every job still running (``kill $(jobs -p)``), to the last one
        (``kill $!``), or to the named ones (``kill $NAME``)."""
        for _, proc, _ in self._chosen(last, name):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                self.killed.add(proc.pid)

    def wait(self, last: bool = False, name: str | None = None) -> None:
        """Wait for every job (``wait``), for the last one (``wait $!``) or for the named ones
        (``wait $NAME``); each must have exited with 0 (or, if ``kill`` reached it before it
        set up its clean stop, by the SIGTERM itself) and without a traceback."""
        failures = []
        waited = self._chosen(last, name)
        self.running = [job for job in self.running if job not in waited]
        for cmd, proc, log in waited:
            rc = proc.wait(timeout=120)
            log.seek(0)
            out = log.read()
            log.close()
            ok = {0, -signal.SIGTERM} if proc.pid in self.killed else {0}
            if rc not in ok or "Traceback" in out:
                failures.append(f"{cmd} exited with {rc}\n{out[-3000:]}")
        assert not failures, "\n".join(failures)


def _run(
    cmd: str, work: Path, subs: dict[str, str], jobs: Jobs
) -> subprocess.CompletedProcess | None:
    if "harness." in cmd:
        for old, new in SHORTER.items():
            cmd = cmd.replace(old, new)
    if "--validator" in cmd and " trainer " in cmd:
        for old, new in SMALLER.items():
            cmd = cmd.replace(old, new)
    if "smollm2" in cmd:
        for old, new in REAL_MODEL.items():
            cmd = cmd.replace(old, new)
    for old, new in subs.items():
        cmd = cmd.replace(old, new)
    if named := re.fullmatch(r"(\w+)=\$\(jobs -p \| tail -n (\d+)\)", cmd):
        jobs.name(named[1], int(named[2]))
        return None
    if named := re.fullmatch(r"(kill|wait) \$(\w+)", cmd):
        (jobs.kill if named[1] == "kill" else jobs.wait)(name=named[2])
        return None
    if cmd in ("kill $(jobs -p)", "kill $!"):
        jobs.kill(last=cmd.endswith("$!"))
        return None
    if cmd in ("wait", "wait $!"):
        jobs.wait(last=cmd.endswith("$!"))
        return None
    background = cmd.endswith(" &")
    argv = shlex.split(cmd.removesuffix(" &"))
    out = None
    if not background and len(argv) > 2 and argv[-2] == ">":
        argv, out = argv[:-2], work / argv[-1]
    if argv[0] == ".venv/bin/prooftrain":
        argv = [sys.executable, "-m", "node.cli", *argv[1:]]
    elif argv[0] == ".venv/bin/python":
        argv = [sys.executable, *argv[1:]]
    if background:
        jobs.start(cmd, argv)
        return None
    result = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    if out is not None:
        out.write_text(result.stdout)
    return result


STAND_IN = """
import pathlib, signal, sys, time
out, delay = pathlib.Path(sys.argv[1]), float(sys.argv[2])
def stop(*_):
    signalled = time.time()
    time.sleep(delay)  # a contributor finishing the groups it is uploading
    out.write_text(f"{signalled} {time.time()}")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
out.with_suffix(".ready").touch()
while True:
    time.sleep(0.05)
"""


def test_the_deployment_stops_the_contributors_before_the_validator(tmp_path: Path) -> None:
    """The README's network block, run against stand-ins (a validator started before it, its
    contributors, no trainer) that note when SIGTERM reached them and when they exited: the
    validator is signalled only after every contributor has finished and exited."""
    block = next(
        b for b in readme_blocks() if any(" trainer " in c and "--validator" in c for c in b)
    )
    jobs = Jobs(tmp_path)

    def stand_in(cmd: str, name: str, delay: float) -> None:
        jobs.start(
            cmd, [sys.executable, "-c", STAND_IN, str(tmp_path / f"{name}.times"), str(delay)]
        )

    stand_in("validator", "validator", 0.0)
    contributors = []
    try:
        for cmd in block:
            if cmd.startswith(".venv/bin/prooftrain contributor"):
                contributors.append(f"contributor{len(contributors)}")
                stand_in(cmd, contributors[-1], 0.5)
            elif not cmd.startswith(".venv/bin/prooftrain trainer"):
                for name in ["validator", *contributors]:  # each stand-in handles SIGTERM by now
                    while not (tmp_path / f"{name}.ready").exists():
                        time.sleep(0.05)
                _run(cmd, tmp_path, {}, jobs)
        assert not jobs.running, "the block leaves jobs running"
    finally:
        jobs.kill()
        for _, proc, _ in jobs.running:
            proc.wait(timeout=60)
    assert len(contributors) == 3
    times = {n: (tmp_path / f"{n}.times").read_text().split() for n in ["validator", *contributors]}
    validator_signalled = float(times["validator"][0])
    assert all(validator_signalled >= float(times[c][1]) for c in contributors)


def _pg_dsn(request: pytest.FixtureRequest) -> str | None:
    """A fresh database on the suite's PostgreSQL server; ``None`` where the PostgreSQL tests
    skip (no server binaries and ``CI`` unset; with ``CI`` set, ``pg_server`` fails instead)."""
    if _pg_bin() is None and not os.environ.get("CI"):
        warnings.warn(
            "PostgreSQL server binaries (initdb) are not installed: the README's "
            "PostgreSQL block is not run",
            stacklevel=2,
        )
        return None
    return request.getfixturevalue("pg_server").create_db()


def test_every_readme_block_runs(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from node.validator.server import free_port
    from verify.keys import load_public_key

    work = tmp_path / "work"
    work.mkdir()
    port, pg_port, real_port = free_port(), free_port(), free_port()
    _prepare(work, port, real_port)
    dsn = _pg_dsn(request)
    subs = {
        "http://127.0.0.1:8470": f"http://127.0.0.1:{port}",
        "http://127.0.0.1:8471": f"http://127.0.0.1:{pg_port}",
        "--port 8471": f"--port {pg_port}",
        "http://127.0.0.1:8472": f"http://127.0.0.1:{real_port}",
        "$PROOFTRAIN_PG_DSN": dsn or "",
    }
    jobs = Jobs(work)
    pg_verified = False
    try:
        for block in readme_blocks()[1:]:
            if dsn is None and any("$PROOFTRAIN_PG_DSN" in cmd for cmd in block):
                continue
            for cmd in block:
                if "CONTRIBUTOR_KEY_HEX" in cmd:
                    subs["CONTRIBUTOR_KEY_HEX"] = load_public_key(
                        work / "keys" / "alice.key.pub"
                    ).hex()
                if "VALIDATOR_KEY_HEX" in cmd:
                    subs["VALIDATOR_KEY_HEX"] = load_public_key(
                        work / "keys" / "validator.key.pub"
                    ).hex()
                result = _run(cmd, work, subs, jobs)
                groups = re.search(r"--groups (\d+)", cmd)
                if cmd.startswith(".venv/bin/prooftrain contributor") and groups:
                    assert result is not None and f"submitted {groups[1]} groups" in result.stdout
                if (
                    cmd.startswith(".venv/bin/prooftrain audit verify")
                    and "$PROOFTRAIN_PG_DSN" in cmd
                ):
                    pg_verified = True
        assert not jobs.running, f"the README leaves {[c for c, _, _ in jobs.running]} running"
    finally:
        jobs.kill()
        for _, proc, _ in jobs.running:
            proc.wait(timeout=60)
    assert (work / "runs" / "demo" / "report.md").is_file()
    assert (work / "entry0.proof").is_file()
    _assert_the_network_trained(work, pg_ran=dsn is not None)
    _assert_the_real_model_ran(work)
    if dsn is not None:
        assert pg_verified
        _assert_the_postgres_node_admitted(dsn)


def _assert_the_network_trained(work: Path, pg_ran: bool) -> None:
    """Three contributors, each with its own state directory, fed a trainer that published three
    versions; the last entry is provable (the clean stop signed a checkpoint covering it). The
    PostgreSQL section's contributor, when it ran, has a fourth state directory."""
    from ledger.records import PolicyPublished, decode_record
    from ledger.storage import open_store

    states = list((work / "runs" / "contributor").iterdir())
    assert len(states) == (4 if pg_ran else 3)
    store = open_store(str(work / "runs" / "validator" / "ledger.sqlite"), readonly=True)
    try:
        records = [decode_record(data) for _, _, data in store.entries()]
    finally:
        store.close()
    assert max(r.version for r in records if isinstance(r, PolicyPublished)) == 3
    assert (work / "last.proof").is_file()


def _assert_the_real_model_ran(work: Path) -> None:
    """SmolLM2's validator accepted the contributor's two groups (audited, every chunk compared),
    and the real-model scenario wrote its report, its int8 contributor slashed."""
    from ledger.records import VerdictRecorded, decode_record
    from ledger.storage import open_store

    store = open_store(str(work / "runs" / "smollm2-validator" / "ledger.sqlite"), readonly=True)
    try:
        verdicts = [
            r
            for r in (decode_record(d) for _, _, d in store.entries())
            if isinstance(r, VerdictRecorded)
        ]
    finally:
        store.close()
    assert sum(v.accepted for v in verdicts) == 2 * 4 and all(v.accepted for v in verdicts)
    report = (work / "runs" / "smollm2_addition" / "report.md").read_text()
    assert "low-precision-copy" in report
    assert (work / "runs" / "smollm2_addition" / "release" / "README.md").is_file()  # released


def _assert_the_postgres_node_admitted(dsn: str) -> None:
    """The PostgreSQL section's node put the contributor's registration and verdicts in that
    database, not in the SQLite ledger of the other node."""
    from ledger.records import ContributorRegistered, VerdictRecorded, decode_record
    from ledger.storage import open_store

    store = open_store(dsn, readonly=True)
    try:
        records = [decode_record(data) for _, _, data in store.entries()]
    finally:
        store.close()
    assert any(isinstance(r, ContributorRegistered) for r in records)
    assert any(isinstance(r, VerdictRecorded) for r in records)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
