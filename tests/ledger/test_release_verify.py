"""Offline release verification: every file, proof and signature is checked, and a failure
names the file at fault.

Two kinds of attack: a byte flipped anywhere (caught by the trainer-signed
file list), and a dishonest trainer who edits a file and re-signs the release
manifest (caught by the validator's checkpoint, the ledger proofs, the chain
replay or the re-rendered eval figures).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from ledger import release_layout as L
from ledger.release import ReleaseError, verify_release
from tests.release_world import TRAINER, VALIDATOR, World, release_fixtures
from trainer.release import build_release
from verify.errors import Reason
from verify.hashing import BLOB, blake3_digest
from verify.keys import SigningKey
from verify.signed import open_sealed, seal
from verify.types import ReleaseFile, ReleaseManifest, SignedRelease, canonical_bytes, decode

world, release = release_fixtures(eval_problems=4)


def _verify(path: Path, **kw: object):  # noqa: ANN202
    return verify_release(
        path,
        trainer_key=kw.get("trainer", TRAINER.public),  # type: ignore[arg-type]
        validator_key=kw.get("validator", VALIDATOR.public),  # type: ignore[arg-type]
        blobs=kw.get("blobs"),
        base_model=kw.get("base_model"),
    )  # type: ignore[arg-type]


def _fails(path: Path, **kw: object) -> ReleaseError:
    with pytest.raises(ReleaseError) as err:
        _verify(path, **kw)
    return err.value


@pytest.fixture
def copy(release: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(release, tmp_path / "release"))


def _manifest(path: Path) -> ReleaseManifest:
    data = (path / L.MANIFEST_FILE).read_bytes()
    return open_sealed(
        ReleaseManifest, decode(SignedRelease, data, max_bytes=len(data)), TRAINER.public
    )


def resign(path: Path, key: SigningKey = TRAINER, **fields: object) -> None:
    """What a dishonest trainer can do: re-list every file and sign again."""
    files = []
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != L.MANIFEST_FILE):
        data = f.read_bytes()
        files.append(
            ReleaseFile(f.relative_to(path).as_posix(), blake3_digest(BLOB, data), len(data))
        )
    rel = msgspec.structs.replace(_manifest(path), files=files, **fields)
    (path / L.MANIFEST_FILE).write_bytes(canonical_bytes(seal(key, rel)))


def test_release_verifies(release: Path) -> None:
    report = _verify(release)
    assert report.version == 3 and report.verdicts == 12 and report.evals == 4 + 2
    assert report.proofs == 1 + 3 + 4 + 12


def _files(release: Path) -> list[str]:
    return sorted(p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file())


def test_every_file_type_is_covered(release: Path) -> None:
    kinds = {f.split("/")[0] if "/" in f else f for f in _files(release)}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "README.md",
        "evals.json",
        "release.manifest",
        "ledger",
        "chain",
        "evals",
    } <= kinds


def test_a_flipped_byte_in_any_file_names_that_file(copy: Path) -> None:
    names = _files(copy)
    assert len(names) > 30
    for name in names:
        target = copy / name
        original = target.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        err = _fails(copy)
        assert err.file == name, str(err)
        assert name in str(err) and err.reason is not None
        target.write_bytes(original)
    _verify(copy)


def _edit_text(rel: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        text = (path / rel).read_text()
        assert old in text
        (path / rel).write_text(text.replace(old, new, 1))

    return edit


def _flip(rel_or_glob: str, at: int = -40) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        target = sorted(path.glob(rel_or_glob))[0]
        data = bytearray(target.read_bytes())
        data[at] ^= 0x01
        target.write_bytes(bytes(data))

    return edit


def _weights(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / L.MODEL_WEIGHTS))
    state["model.norm.weight"] = state["model.norm.weight"] + 1e-3
    save_file(state, str(path / L.MODEL_WEIGHTS), metadata={"format": "pt"})


def _evals_json(path: Path) -> None:
    doc = json.loads((path / L.EVALS_FILE).read_text())
    doc["table"][0]["release"]["pass@1 (greedy)"]["value"] = 0.99
    (path / L.EVALS_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _card(path: Path) -> None:
    text = (path / L.CARD_FILE).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| pass@1 (greedy) |"))
    (path / L.CARD_FILE).write_text(text.replace(row, "| pass@1 (greedy) | 0.1 | 0.9 |"))


def _drop_proof(path: Path) -> None:
    sorted((path / L.PROOFS_DIR).glob("*.proof"))[-1].unlink()


def _swap_proof_hash(path: Path) -> None:
    target = sorted((path / L.PROOFS_DIR).glob("*.proof"))[3]
    lines = target.read_text().split("\n")
    lines[3] = "A" * 43 + "="
    target.write_text("\n".join(lines))


# (edit, file the failure must name); each edit is followed by a valid re-signature
SEMANTIC = {
    "weights": (_weights, L.MODEL_WEIGHTS),
    "checkpoint": (_edit_text(L.CHECKPOINT_FILE, "\n\n", "\n\n "), L.CHECKPOINT_FILE),
    "leaves": (_flip(L.LEAVES_FILE, 5), L.LEAVES_FILE),
    "records": (_flip(L.RECORDS_FILE, -3), L.RECORDS_FILE),
    "proof_hash": (_swap_proof_hash, None),
    "proof_missing": (_drop_proof, None),
    "evals_json": (_evals_json, L.EVALS_FILE),
    "card": (_card, L.CARD_FILE),
    "table_statement": (
        _flip("evals/table/*.release.bin", -70),
        "evals/table/arithmetic.release.bin",
    ),
    "curve_statement": (_flip("evals/ledger/*.bin", -70), None),
    "policy_manifest": (_flip("chain/manifests/*.bin", -70), L.manifest_path(1)),
    "update_blob": (_flip("chain/blobs/*", -5), None),
    "base_weights": (
        _flip("chain/base/model.safetensors", -5),
        f"{L.CHAIN_BASE}/{L.MODEL_WEIGHTS}",
    ),
    "config": (_edit_text("config.json", "}", ', "x": 1}'), None),
}


@pytest.mark.parametrize("case", sorted(SEMANTIC))
def test_a_resigned_edit_is_caught_and_named(copy: Path, case: str) -> None:
    edit, expected_file = SEMANTIC[case]
    before = set(_files(copy))
    snapshot = {f: (copy / f).read_bytes() for f in before}
    edit(copy)
    changed = [
        f for f in before if not (copy / f).exists() or (copy / f).read_bytes() != snapshot[f]
    ]
    resign(copy)
    if (
        case == "config"
    ):  # only the trainer's signature covers it: re-signed, it is the trainer's word
        _verify(copy)
        return
    err = _fails(copy)
    assert err.file == (expected_file or changed[0]), str(err)
    assert err.file in str(err) and err.reason is not None


def test_resigned_manifest_fields_are_checked(copy: Path) -> None:
    rel = _manifest(copy)
    cases = {
        "verdict_count": (rel.verdict_count - 1, L.MANIFEST_FILE),
        "weights_digest": (b"\x00" * 32, L.MANIFEST_FILE),
        "checkpoint_size": (rel.checkpoint_size + 1, L.CHECKPOINT_FILE),
        "base_digest": (b"\x01" * 32, L.manifest_path(1)),
        "log_key": (SigningKey.from_seed(b"\x01" * 32).public.raw, L.MANIFEST_FILE),
    }
    original = (copy / L.MANIFEST_FILE).read_bytes()
    for field, (value, expected_file) in cases.items():
        (copy / L.MANIFEST_FILE).write_bytes(original)
        resign(copy, **{field: value})
        err = _fails(copy)
        assert err.file == expected_file, (field, str(err))
    (copy / L.MANIFEST_FILE).write_bytes(original)
    _verify(copy)


def test_wrong_keys_fail(release: Path) -> None:
    other = SigningKey.from_seed(b"\x07" * 32).public
    err = _fails(release, trainer=other)
    assert err.file == L.MANIFEST_FILE and err.reason is Reason.BAD_SIGNATURE
    err = _fails(release, validator=other)
    assert err.file == L.CHECKPOINT_FILE


def test_signed_by_another_trainer_fails(copy: Path) -> None:
    resign(copy, key=SigningKey.from_seed(b"\x08" * 32))
    assert _fails(copy).file == L.MANIFEST_FILE


def test_extra_and_missing_files_are_named(copy: Path) -> None:
    (copy / "extra.txt").write_text("x")
    assert _fails(copy).file == "extra.txt"
    (copy / "extra.txt").unlink()
    (copy / "tokenizer.json").unlink()
    assert _fails(copy).file == "tokenizer.json"


def test_release_without_the_chain_verifies_against_external_blobs(
    world: World, tmp_path: Path
) -> None:
    out = build_release(
        ledger=world.ledger,
        out=tmp_path / "thin",
        base_model=world.model,
        trainer_key=TRAINER,
        eval_problems=2,
        k=1,
        progress=False,
        ship_chain=False,
        version=2,
    )
    assert not (out / L.CHAIN_BASE).exists() and not (out / L.CHAIN_BLOBS).exists()
    blobs = Path(str(world.ledger) + ".blobs")
    report = _verify(out, blobs=blobs, base_model=world.model)
    assert report.version == 2 and report.verdicts == 8
    assert _fails(out, base_model=world.model).file.startswith(L.CHAIN_BLOBS)
    assert _fails(out, blobs=blobs).file == f"{L.CHAIN_BASE}/{L.MODEL_WEIGHTS}"


def test_replay_matches_the_contributor_rebuild(world: World, release: Path) -> None:
    from safetensors.torch import load_file

    from ledger.blobs import FileBlobStore
    from rollout.sync import PolicySync

    blobs = Path(str(world.ledger) + ".blobs")
    sync = PolicySync(
        world.model, TRAINER.public, lambda v: world.manifests[v - 1], FileBlobStore(blobs).get, 2
    )
    released = load_file(str(release / L.MODEL_WEIGHTS))
    for name, t in sync.state_at(3).items():
        assert torch.equal(t, released[name])


def test_release_of_the_base_model(world: World, tmp_path: Path) -> None:
    out = build_release(
        ledger=world.ledger,
        out=tmp_path / "v0",
        base_model=world.model,
        trainer_key=TRAINER,
        eval_problems=2,
        k=1,
        progress=False,
        version=0,
    )
    report = _verify(out)
    assert (
        report.version == 0
        and report.verdicts == 0
        and report.weights_digest == _manifest(out).weights_digest.hex()
    )
    assert (out / L.MODEL_WEIGHTS).read_bytes() != b""
    assert not (out / L.CHAIN_MANIFESTS).exists()


def test_unreadable_weights_are_named(copy: Path) -> None:
    (copy / L.MODEL_WEIGHTS).write_bytes(b"\xff" * 64)
    resign(copy)
    err = _fails(copy)
    assert err.file == L.MODEL_WEIGHTS and err.reason is Reason.MALFORMED
