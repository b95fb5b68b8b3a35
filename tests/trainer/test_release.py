"""Release building: the trainer's evals in the ledger, the release directory, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from ledger import release_layout as L
from ledger.records import EvalRecorded
from node.client import ServiceError, ValidatorClient
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from rollout.loading import load_pretrained_lm
from tests.release_world import TRAINER, VALIDATOR, World, release_fixtures
from trainer.evals import EvalReport, Metric, eval_statement, evaluate, report_from_statement
from trainer.release import build_release
from verify.errors import AdmissionError, ConfigError, Reason
from verify.keys import SigningKey, save_signing_key
from verify.manifest import manifest_digest
from verify.signed import open_sealed, seal
from verify.types import EvalStatement, SignedEvalStatement, decode

REPO = Path(__file__).resolve().parents[2]
REPORT = EvalReport(
    "m",
    "arithmetic",
    "heldout",
    5,
    (Metric("pass@1 (greedy)", 0.4, 0.1, 0.8, 5), Metric("pass@2", 0.6, 0.2, 0.9, 5)),
)


world, release = release_fixtures(eval_problems=6)


def _statement(version: int, digest: bytes, key: SigningKey = TRAINER) -> SignedEvalStatement:
    return eval_statement(
        REPORT,
        version=version,
        manifest_digest=digest,
        task="arithmetic",
        split="heldout",
        seed=3,
        key=key,
        created_at_ms=9,
    )


def test_eval_statement_round_trips() -> None:
    sealed = _statement(0, b"")
    stmt = open_sealed(EvalStatement, sealed, TRAINER.public)
    back = report_from_statement(stmt)
    assert back.metrics == REPORT.metrics and back.problems == 5 and back.task == "arithmetic"
    assert stmt.seed == 3 and stmt.trainer_key == TRAINER.public.raw


def test_record_eval_checks_signer_version_and_manifest(world: World) -> None:
    v = world.validator
    digest = manifest_digest(world.manifests[0])
    before = v.ledger.size()
    index = v.record_eval(_statement(1, digest))
    rec = dict(v.ledger.entries(index))[index]
    assert isinstance(rec, EvalRecorded) and rec.version == 1
    assert v.ledger.latest_checkpoint().checkpoint.size == index + 1  # provable at once
    assert v.record_eval(_statement(1, digest)) == index  # sent again: recorded once
    stranger = SigningKey.from_seed(b"\x55" * 32)
    bad = {
        Reason.BAD_SIGNATURE: _statement(1, digest, stranger),
        Reason.FUTURE_VERSION: _statement(9, digest),
        Reason.WRONG_MANIFEST: _statement(2, digest),
    }
    for reason, sealed in bad.items():
        with pytest.raises(AdmissionError) as err:
            v.record_eval(sealed)
        assert err.value.reason is reason
    with pytest.raises(AdmissionError) as err:
        v.record_eval(_statement(0, digest))  # version 0 names no manifest
    assert err.value.reason is Reason.WRONG_MANIFEST
    forged = msgspec.structs.replace(_statement(1, digest), signature=b"\x00" * 64)
    with pytest.raises(AdmissionError):
        v.record_eval(forged)
    assert v.ledger.size() == before + 1
    from ledger.audit import verify_ledger

    audit = verify_ledger(v.ledger.store, log_key=v.ledger.verifier, blobs=v.ledger.blobs)
    assert audit.ok, [str(f) for f in audit.findings]


def test_eval_endpoint_is_trainer_only(world: World) -> None:
    v = world.validator
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        trainer = ValidatorClient(url, TRAINER, retries=0)
        index = trainer.record_eval(_statement(0, b""))
        assert isinstance(dict(v.ledger.entries(index))[index], EvalRecorded)
        other = ValidatorClient(url, SigningKey.from_seed(b"\x56" * 32), retries=0)
        with pytest.raises(ServiceError) as err:
            other.record_eval(_statement(0, b""))
        assert err.value.status == 401
        trainer.close()
        other.close()


def test_manifests_are_in_the_blob_store(world: World) -> None:
    from trainer.release import index_signed_blobs

    manifests, statements = index_signed_blobs(world.validator.ledger.blobs)
    assert {manifest_digest(m) for m in world.manifests} <= set(manifests)
    assert len(statements) >= 4


def test_release_loads_and_reproduces_its_card(release: Path) -> None:
    model = load_pretrained_lm(release)
    assert model.config.num_hidden_layers == 2
    data = (release / L.table_path("arithmetic", "release")).read_bytes()
    stmt = decode(
        EvalStatement,
        decode(SignedEvalStatement, data, max_bytes=len(data)).statement,
        max_bytes=len(data),
    )
    assert stmt.version == 3
    card_pass1 = next(m for m in stmt.metrics if m.name == "pass@1 (greedy)")
    card = (release / L.CARD_FILE).read_text()
    assert f"{card_pass1.value:.4f} [{card_pass1.lo:.4f}, {card_pass1.hi:.4f}]" in card
    again = evaluate(
        release, "arithmetic", "heldout", n=stmt.problems, k=2, seed=stmt.seed, device="cpu"
    ).metric("pass@1 (greedy)")
    assert card_pass1.lo <= again.value <= card_pass1.hi
    assert again.value == card_pass1.value  # greedy decoding is deterministic
    curve = json.loads((release / L.EVALS_FILE).read_text())["curve"]
    assert [p["version"] for p in curve] == sorted(p["version"] for p in curve)
    assert {p["version"] for p in curve} == {0, 1, 2, 3}


def test_build_refusals(world: World, release: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        build_release(
            ledger=world.ledger,
            out=release,
            base_model=world.model,
            trainer_key=TRAINER,
            progress=False,
        )
    with pytest.raises(ConfigError, match="not published"):
        build_release(
            ledger=world.ledger,
            out=tmp_path / "x",
            base_model=world.model,
            trainer_key=TRAINER,
            version=7,
            progress=False,
        )
    assert not (tmp_path / "x").exists()


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_builds_verifies_and_names_a_tampered_file(world: World, tmp_path: Path) -> None:
    key_file = tmp_path / "trainer.key"
    save_signing_key(TRAINER, key_file)
    out = tmp_path / "cli-release"
    built = _cli(
        "release",
        "--ledger",
        str(world.ledger),
        "--out",
        str(out),
        "--base-model",
        str(world.model),
        "--trainer-key",
        str(key_file),
        "--version",
        "2",
        "--eval-problems",
        "3",
        "-k",
        "1",
    )
    assert built.returncode == 0, built.stderr
    # stderr is a pipe: whole progress lines, the eval step counted in completions with an ETA
    assert "\r" not in built.stderr
    lines = built.stderr.splitlines()
    assert any(line.startswith("release: 0/5 step (0%)") for line in lines)
    assert any(line.startswith("release: 5/5 step (100%)") for line in lines)
    evals = [line for line in lines if line.startswith("release eval: ")]
    assert evals[0].startswith("release eval: 0/") and "completions" in evals[0]
    assert "(100%)" in evals[-1]
    keys = ["--trainer-key", TRAINER.public.hex(), "--validator-key", VALIDATOR.public.hex()]
    ok = _cli("release", "verify", str(out), *keys)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok: release of policy version 2" in ok.stdout
    config = out / "config.json"
    config.write_text(config.read_text().replace("}", " }", 1))
    bad = _cli("release", "verify", str(out), *keys, "--json")
    assert bad.returncode == 1
    result = json.loads(bad.stdout)
    assert result["file"] == "config.json" and result["reason"] == "digest_mismatch"
    assert result["expected"] and result["computed"]


@pytest.mark.slow
def test_eval_command_in_the_card_reproduces_it(release: Path) -> None:
    """The card's reproduction command, run as written inside the release, gives its pass@1."""
    command = next(
        line
        for line in (release / L.CARD_FILE).read_text().splitlines()
        if line.startswith("prooftrain eval . ")
    )
    evaluated = _cli(*command.split()[1:], "--json", "--device", "cpu", cwd=release)
    assert evaluated.returncode == 0, evaluated.stderr
    data = (release / L.table_path("arithmetic", "release")).read_bytes()
    stmt = decode(
        EvalStatement,
        decode(SignedEvalStatement, data, max_bytes=len(data)).statement,
        max_bytes=len(data),
    )
    card = next(m for m in stmt.metrics if m.name == "pass@1 (greedy)")
    got = json.loads(evaluated.stdout)["metrics"]["pass@1 (greedy)"]
    assert card.lo <= got["value"] <= card.hi and got["value"] == card.value


def test_seal_of_a_statement_is_stable() -> None:
    stmt = open_sealed(EvalStatement, _statement(0, b""), TRAINER.public)
    assert seal(TRAINER, stmt) == _statement(0, b"")
    assert torch.__version__.startswith("2.13")
