"""Issue 48: two validator processes over one PostgreSQL log, with one key, are one service.

Validator A and validator B share the log, the sample bodies (in PostgreSQL) and a blob
directory; contributor c0 works for A, c1 and c2 for B. The trainer trains versions 1 and 2
through A, stops, and continues from its checkpoint through B to version 4. Then:

- every version is published once, in order, and B's contributors generated from a version
  the trainer published through A;
- the trainers' journal and last checkpoint account for every accepted sample below the
  last cursor exactly once (trained, or held for the next step), and those samples come
  from contributors of both nodes;
- each contributor has exactly one ``contributor_admitted``; ``audit verify`` is ok.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from ledger.records import (
    AssignmentIssued,
    ContributorRegistered,
    PolicyPublished,
    VerdictRecorded,
    decode_record,
)
from ledger.storage import open_store
from node.validator.server import free_port, wait_healthy
from tests.integration.test_deployment import _cli, _start, _stop
from tests.ledger.conftest import pg_server  # noqa: F401  (fixture: a private PostgreSQL server)
from verify.keys import load_public_key
from verify.types import AcceptedSample, decode

CHECKPOINTS = Path("runs/trainer/checkpoints")
JOURNAL = CHECKPOINTS / "journal" / "stage0.jsonl"


def _config(work: Path, name: str, ledger: str, model: Path) -> str:
    path = work / f"{name}.toml"
    path.write_text(
        f'[node]\nledger = "{ledger}"\ntrainer_key = "keys/trainer.key.pub"\n'
        f'admission_processes = 0\nblob_dir = "runs/blobs"\nstate_file = "runs/{name}.state"\n'
        f'[policy]\nmodel_dir = "{model}"\n[task]\npool = 256\n'
        "[assignment]\ngroup_size = 4\nmax_tokens = 8\n[audit]\nqueue = 32\nepoch_groups = 2\n"
        "[rules]\nmax_staleness = 100\naudit_rate = -1.0\n"
        "[registration]\nwork_bits = 4\nwork_log2_n = 4\n"
    )
    return path.name


def _trainer(url: str, model: Path, steps: int) -> list[str]:
    args = ["trainer", "--validator", url, "--trainer-key", "keys/trainer.key"]
    args += ["--model", str(model), "--steps", str(steps), "--quiet"]
    for item in ("batch_groups=1", "skip_uniform_groups=false", "eval_every=0"):
        args += ["--set", item]
    return args


def _log(ledger: str) -> list[tuple[int, object]]:
    store = open_store(ledger, readonly=True)
    try:
        return [(idx, decode_record(data)) for idx, _, data in store.entries()]
    finally:
        store.close()


@pytest.mark.slow  # about 90 s: two nodes, three contributors, two trainer runs
def test_two_validators_on_one_postgres_log_serve_one_trainer(
    tmp_path: Path, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    work = tmp_path
    ledger = request.getfixturevalue("pg_server").create_db()
    for name in ("validator", "trainer", "c0", "c1", "c2"):
        _cli(work, "keys", "new", "--out", f"keys/{name}.key")
    ports = {name: free_port() for name in ("a", "b")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    nodes: list[subprocess.Popen] = []
    contributors: list[subprocess.Popen] = []
    try:
        for name in ("a", "b"):  # one after the other: the first creates the log
            config = _config(work, name, ledger, tiny_model)
            nodes.append(_start(work, "validator", "--config", config, "--port", str(ports[name])))
            wait_healthy(ports[name], nodes[-1])
        for i, name in enumerate(("a", "b", "b")):
            args = ("--validator", urls[name], "--model", str(tiny_model))
            contributors.append(_start(work, "contributor", *args, "--key", f"keys/c{i}.key"))
        _cli(work, *_trainer(urls["a"], tiny_model, 2))
        resumed = _cli(work, *_trainer(urls["b"], tiny_model, 4))
        assert "resumed at policy version 2 from the checkpoint" in resumed.stderr, resumed.stderr
    finally:
        outputs = [_stop(c) for c in contributors]
        node_outputs = [_stop(n) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), [out[-3000:] for out in node_outputs]
    assert all("Traceback" not in out for out in outputs), outputs

    log = _log(ledger)
    assert [r.version for _, r in log if isinstance(r, PolicyPublished)] == [1, 2, 3, 4]
    keys = {i: load_public_key(str(work / f"keys/c{i}.key.pub")).raw for i in range(3)}
    issued = {r.assignment_id: r for _, r in log if isinstance(r, AssignmentIssued)}
    verdicts = {i: r for i, r in log if isinstance(r, VerdictRecorded) and r.accepted}
    on_b = {
        issued[r.assignment_id].policy_version
        for r in verdicts.values()
        if r.contributor != keys[0]
    }
    assert on_b - {0}, "B's contributors never generated from a version published through A"

    steps = [json.loads(line) for line in (work / JOURNAL).read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    consumed = [i for s in steps for i in s["trained"] + s["dropped"]]
    assert len(consumed) == len(set(consumed))  # none twice
    buffer = torch.load(work / CHECKPOINTS / "v00000004" / "stage0.pt", weights_only=False)[
        "buffer"
    ]
    held = [decode(AcceptedSample, raw, max_bytes=len(raw)).ledger_index for raw in buffer["held"]]
    assert not set(held) & set(consumed)
    # Every accepted sample the trainers read, from either node, was trained (or is held for
    # the next step): none skipped, none missing.
    assert set(consumed) | set(held) == {i for i in verdicts if i < buffer["cursor"]}
    read = {verdicts[i].contributor for i in [*consumed, *held]}
    assert keys[0] in read and read & {keys[1], keys[2]}  # bodies stored by both nodes

    admitted = [r.contributor for _, r in log if isinstance(r, ContributorRegistered)]
    assert sorted(admitted) == sorted(keys.values())  # each key once
    _cli(
        work, "audit", "verify", ledger, "--key", "keys/validator.key.pub", "--blobs", "runs/blobs"
    )
