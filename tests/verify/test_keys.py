"""Identity keys: 0600 files, no overwrite, encryption, and secrets that never leak."""

from __future__ import annotations

import io
import logging
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from verify.errors import KeyFileError, Reason, SignatureError
from verify.keys import (
    PublicKey,
    SigningKey,
    is_encrypted,
    load_public_key,
    load_signing_key,
    save_signing_key,
)

SEED = bytes(range(100, 132))


def _secret_forms(key: SigningKey) -> list[str]:
    seed = key._seed()
    return [seed.hex(), seed.hex().upper(), repr(seed), str(list(seed))[:40]]


def test_key_file_is_created_0600_and_never_overwritten(tmp_path: Path) -> None:
    key = SigningKey.from_seed(SEED)
    path = save_signing_key(key, tmp_path / "sub" / "validator.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_signing_key(path).public == key.public
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        save_signing_key(SigningKey.generate(), path)
    assert load_signing_key(path).public == key.public
    assert [p.name for p in path.parent.iterdir()] == ["validator.key"]  # no temp files left


def test_0600_holds_under_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = save_signing_key(SigningKey.generate(), tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_encrypted_round_trip_and_wrong_passphrase(tmp_path: Path) -> None:
    key = SigningKey.from_seed(SEED)
    path = save_signing_key(key, tmp_path / "k", passphrase=b"correct horse")
    assert is_encrypted(path)
    assert SEED.hex() not in path.read_text()
    assert load_signing_key(path, b"correct horse").public == key.public
    with pytest.raises(KeyFileError) as exc:
        load_signing_key(path, b"wrong")
    assert exc.value.reason is Reason.BAD_PASSPHRASE
    assert "wrong passphrase" in str(exc.value)
    with pytest.raises(KeyFileError) as exc:
        load_signing_key(path)
    assert exc.value.reason is Reason.BAD_PASSPHRASE


def test_secret_bytes_appear_in_no_repr_log_or_exception(tmp_path: Path) -> None:
    key = SigningKey.from_seed(SEED)
    path = save_signing_key(key, tmp_path / "k")
    texts = [repr(key), str(key), f"{key}", repr(key.public), key.public.fingerprint]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("prooftrain.test")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        log.info("loaded %s", key)
        log.info("key %r", load_signing_key(path))
    finally:
        log.removeHandler(handler)
    texts.append(stream.getvalue())
    corrupt = tmp_path / "corrupt"
    corrupt.write_bytes(path.read_bytes()[:-20])
    locked = save_signing_key(key, tmp_path / "locked", passphrase=b"pw")
    for bad in (
        lambda: load_signing_key(corrupt),
        lambda: load_signing_key(locked, b"wrong"),
        lambda: save_signing_key(key, path),
        lambda: key.public.verify(b"m", b"\x00" * 64),
    ):
        with pytest.raises(Exception) as exc:
            bad()
        texts += [str(exc.value), repr(exc.value)]
    with pytest.raises(TypeError):
        pickle.dumps(key)
    joined = "\n".join(texts)
    for form in _secret_forms(key):
        assert form not in joined


def test_cli_never_prints_the_secret(tmp_path: Path) -> None:
    env = {**os.environ, "PROOFTRAIN_KEY_PASSPHRASE": "s3cret-pass"}
    out = tmp_path / "node.key"
    cmd = [sys.executable, "-m", "node.cli", "keys"]
    made = subprocess.run(
        [*cmd, "new", "--out", str(out), "--encrypt"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    shown = subprocess.run(
        [*cmd, "show", str(out), "--json"], env=env, capture_output=True, text=True, check=True
    )
    key = load_signing_key(out, b"s3cret-pass")
    assert key.public.hex() in shown.stdout
    assert (tmp_path / "node.key.pub").read_text().strip() == key.public.hex()
    for text in (made.stdout, made.stderr, shown.stdout, shown.stderr):
        for form in _secret_forms(key) + ["s3cret-pass"]:
            assert form not in text
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    wrong = subprocess.run(
        [*cmd, "show", str(out)],
        capture_output=True,
        text=True,
        env={**env, "PROOFTRAIN_KEY_PASSPHRASE": "nope"},
    )
    assert wrong.returncode == 1 and "wrong passphrase" in wrong.stderr
    again = subprocess.run([*cmd, "new", "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr


def test_signatures_and_public_key_parsing(tmp_path: Path) -> None:
    key = SigningKey.from_seed(SEED)
    sig = key.sign(b"message")
    key.public.verify(b"message", sig)
    with pytest.raises(SignatureError):
        key.public.verify(b"messagf", sig)
    with pytest.raises(SignatureError) as exc:
        key.public.verify(b"message", sig[:-1])
    assert exc.value.reason is Reason.BAD_SIGNATURE
    assert PublicKey.from_hex(key.public.hex()) == key.public
    assert load_public_key(key.public.hex()) == key.public
    pub = tmp_path / "k.pub"
    pub.write_text(key.public.hex() + "\n")
    assert load_public_key(pub) == key.public
    with pytest.raises(KeyFileError):
        PublicKey(b"\x00" * 31)
    with pytest.raises(KeyFileError):
        PublicKey.from_hex("zz")
    assert len(key.public.fingerprint) == 16
