"""Issue 48: several validators over one PostgreSQL log share what a trainer or another node
reads (sample bodies, answers, accepted completions, manifests), register each key once, and
follow what the others append (keys, prompts, policy versions, epochs)."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest

from ledger.audit import verify_ledger
from ledger.log import Ledger
from ledger.records import ContributorRegistered, EpochCommitted, EpochRevealed, EpochVerdict
from node.config import ValidatorConfig, load
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.shared_state import SharedStateStore
from node.validator.state import StateStore
from rewards.tasks.base import generate
from rollout.oracle import TransformersOracle
from tests.ledger.conftest import PgServer, pg_server  # noqa: F401  (fixture)
from tests.node.test_validator_core import honest_group, verdicts
from verify.keys import SigningKey
from verify.registration import WorkParams, solve
from verify.spotcheck import FLOAT32_TOLERANCE
from verify.types import canonical_bytes

KEY = SigningKey.from_seed(b"\x05" * 32)
ALICE = SigningKey.from_seed(b"\x61" * 32)
WORK = {"registration.work_bits": 4, "registration.work_log2_n": 4}
A1, A2, P = b"\x01" * 16, b"\x02" * 16, b"\x0b" * 32


def _d(i: int) -> bytes:
    return bytes([i]) * 32


def test_state_shared_by_two_nodes_local_parts_stay_local(
    pg_server: PgServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    dsn = pg_server.create_db()
    a = SharedStateStore(dsn, StateStore(tmp_path / "a.state"))
    b = SharedStateStore(dsn, StateStore(tmp_path / "b.state"))
    try:
        a.store_samples([(A1, [(_d(1), b"body one"), (_d(2), b"body two")])], [(P, A1, [_d(7)])])()
        assert b.sample(_d(2), A1) == b"body two"
        assert b.sample(_d(2), A2) is None  # a member of another group: not this one
        assert b.sample(_d(3), A1) is None
        assert b.seen_completions(P, [_d(7), _d(8)], A2) == {_d(7)}  # a copy, on the other node
        assert b.seen_completions(P, [_d(7)], A1) == set()  # its own group, sent again
        a.put_submissions([(A1, _d(9), b"answer")])
        assert b.submission(A1) == (_d(9), b"answer")
        a.put_manifest(3, b"sealed manifest")
        assert b.manifest(3) == b"sealed manifest"
        a.put_assignment(A1, b"sealed assignment")
        a.put_epoch(1, b"s" * 32)
        assert b.assignment(A1) is None and b.unrevealed_epochs() == []  # each node's own
        assert a.assignment(A1) == b"sealed assignment"
        assert a.unrevealed_epochs() == [(1, b"s" * 32)]
        a.local.put_samples([(A2, [(_d(4), b"stored before")])], [])  # a deployment from before
        assert a.sample(_d(4), A2) == b"stored before" and b.sample(_d(4), A2) is None
        with pytest.raises(TypeError):
            a.put_samples([(A2, [(b"short", b"x")])], [])
        assert b.sample(b"short", A2) is None
    finally:
        a.close()
        b.close()


@pytest.fixture
def node_pair(pg_server: PgServer, tmp_path: Path, tiny_model: Path, codec: HFTextCodec):  # noqa: F811
    dsn = pg_server.create_db()
    made: list[Validator] = []

    def make(name: str, overrides: dict | None = None) -> Validator:
        cfg = load(
            ValidatorConfig,
            None,
            {"node.ledger": dsn, "rules.audit_rate": 1.0, **(overrides or {})},
        )
        ledger = Ledger.open(dsn, signing_key=KEY, origin="test/validator", blobs=tmp_path / "b")
        state = SharedStateStore(dsn, StateStore(tmp_path / f"{name}.state"))
        v = Validator(
            cfg,
            KEY,
            ledger,
            state,
            codec,
            TransformersOracle({0: tiny_model}),
            generate("arithmetic", "train", 64),
            PolicyVersions(model_dir_digest(tiny_model)),
            FLOAT32_TOLERANCE,
        )
        made.append(v)
        return v

    yield make
    for v in made:
        v.ledger.close()
        v.state.close()


def _registrations(v: Validator, key: bytes) -> int:
    return sum(
        1
        for _, r in v.ledger.entries()
        if isinstance(r, ContributorRegistered) and r.contributor == key
    )


def test_a_key_registered_on_one_node_is_known_on_the_other(node_pair) -> None:
    a, b = node_pair("a", WORK), node_pair("b", WORK)
    work = solve(ALICE.public.raw, a.ledger.origin, WorkParams(4, 4))
    assert a.register(ALICE.public.raw, "alice", work)
    assert not b.register(ALICE.public.raw, "alice")  # known: no proof of work asked again
    b.assign(ALICE.public.raw)  # and given work
    assert _registrations(a, ALICE.public.raw) == 1


def test_two_nodes_racing_to_register_one_key_record_it_once(node_pair) -> None:
    a, b = node_pair("a"), node_pair("b")
    keys = [SigningKey.from_seed(bytes([i]) * 32).public.raw for i in range(100, 130)]
    results: dict[str, list[bool]] = {}
    start = threading.Barrier(2)

    def run(name: str, v: Validator) -> None:
        start.wait()
        results[name] = [v.register(k) for k in keys]

    threads = [threading.Thread(target=run, args=(n, v)) for n, v in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(x != y for x, y in zip(results["a"], results["b"], strict=True))  # one node each
    assert all(_registrations(a, k) == 1 for k in keys)


def test_nodes_take_distinct_epochs_and_the_shared_log_audits_clean(node_pair) -> None:
    a = node_pair("a")
    b = node_pair("b")
    a._epochs._start_next()  # a commits after b: the next number after b's
    epochs = [r.epoch for _, r in a.ledger.entries() if isinstance(r, EpochCommitted)]
    assert epochs == [1, 2, 3]
    assert (a._epochs.epoch, b._epochs.epoch) == (3, 2)
    report = verify_ledger(a.ledger.store, log_key=a.ledger.verifier)
    assert report.ok, [str(f) for f in report.findings]


def test_draws_of_two_nodes_with_interleaved_epochs_audit_clean(node_pair, backend, codec) -> None:
    """Each node draws under its own epoch while the other commits and reveals its own: every
    verdict names the epoch that drew it, so `audit verify` redoes each draw with the right
    secret (checked against the last epoch committed before it, half of them would not match)."""
    rates = {"rules.audit_rate": -1.0, "audit.epoch_groups": 3, "assignment.max_prompt_share": 1.0}
    a, b = node_pair("a", rates), node_pair("b", rates)
    bob = SigningKey.from_seed(b"\x62" * 32)
    for _ in range(12):
        for v, key in ((a, ALICE), (b, bob)):
            group = honest_group(v, backend, codec, key)
            assert all(x.accepted for x in verdicts(v, v.submit(canonical_bytes(group))))
    a.follow()
    drawn = [r for _, r in a.ledger.entries() if isinstance(r, EpochVerdict)]
    assert {r.audited for r in drawn} == {True, False} and min(r.audit_rate for r in drawn) < 0.7
    epochs_of = {r.epoch for r in drawn}
    assert len(epochs_of) >= 6  # both nodes rolled their epochs several times
    report = verify_ledger(a.ledger.store, log_key=a.ledger.verifier)
    assert report.ok, [str(f) for f in report.findings]
    assert report.draws_checked >= 90


def test_a_verdict_naming_an_epoch_already_revealed_is_a_finding(node_pair, backend, codec) -> None:
    a = node_pair("a", {"rules.audit_rate": -1.0})
    group = honest_group(a, backend, codec, ALICE)
    a.submit(canonical_bytes(group))
    (index, v), *_ = [(i, r) for i, r in a.ledger.entries() if isinstance(r, EpochVerdict)]
    secret = a._epochs.current  # noqa: SLF001
    a.ledger.append(EpochRevealed(v.epoch, secret, 1))
    a.ledger.append(msgspec.structs.replace(v, assignment_id=b"\x09" * 16))
    a.ledger.append(msgspec.structs.replace(v, epoch=v.epoch + 7))
    report = verify_ledger(a.ledger.store, log_key=a.ledger.verifier)
    messages = [str(f) for f in report.findings]
    assert any(f"epoch {v.epoch}, whose secret was revealed" in m for m in messages), messages
    assert any(f"epoch {v.epoch + 7}, not committed before it" in m for m in messages), messages
