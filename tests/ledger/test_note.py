"""C2SP signed notes: the golang.org/x/mod/sumdb/note vector, key ids, attacks."""

from __future__ import annotations

import base64

import pytest

from ledger.note import (
    ALG_COSIGNATURE_V1,
    Signer,
    Verifier,
    key_id,
    parse_note,
    sign_note,
    verify_note,
)
from verify.errors import DecodeError, SignatureError, VerificationError
from verify.keys import SigningKey

# golang.org/x/mod/sumdb/note: the PeterNeumann example key and signed note.
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
GO_NOTE = (
    GO_TEXT + "\n— PeterNeumann "
    "x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)


def go_signer() -> Signer:
    material = base64.b64decode(GO_SKEY.split("+", 4)[4])
    assert material[0] == 1
    return Signer("PeterNeumann", SigningKey.from_seed(material[1:]))


def test_go_vector_sign_and_verify() -> None:
    signer = go_signer()
    assert signer.verifier.vkey() == GO_VKEY
    assert signer.verifier.key_id.hex() == "c74f20a3"
    assert sign_note(GO_TEXT, [signer]).to_text() == GO_NOTE
    note = parse_note(GO_NOTE)
    assert note.text == GO_TEXT
    assert verify_note(note, [Verifier.from_vkey(GO_VKEY)])[0].name == "PeterNeumann"


def test_tampered_text_is_rejected() -> None:
    note = parse_note(GO_NOTE.replace("cryptography", "cryptographY"))
    with pytest.raises(SignatureError):
        verify_note(note, [Verifier.from_vkey(GO_VKEY)])


def test_unknown_keys_are_ignored_but_one_known_must_sign() -> None:
    other = Signer("other.example/key", SigningKey.from_seed(b"\x07" * 32))
    note = sign_note(GO_TEXT, [other, go_signer()])
    assert [v.name for v in verify_note(note, [Verifier.from_vkey(GO_VKEY)])] == ["PeterNeumann"]
    with pytest.raises(SignatureError):
        verify_note(sign_note(GO_TEXT, [other]), [Verifier.from_vkey(GO_VKEY)])
    # same name, different key: its id differs, so it is unknown, not a failure
    impostor = Signer("PeterNeumann", SigningKey.from_seed(b"\x08" * 32))
    with pytest.raises(SignatureError):
        verify_note(sign_note(GO_TEXT, [impostor]), [Verifier.from_vkey(GO_VKEY)])


def test_known_key_with_bad_signature_rejects_the_note() -> None:
    good = sign_note(GO_TEXT, [go_signer()]).to_text()
    sig_b64 = good.rsplit(" ", 1)[1].strip()
    raw = bytearray(base64.b64decode(sig_b64))
    raw[10] ^= 1
    bad = good.replace(sig_b64, base64.b64encode(bytes(raw)).decode())
    with pytest.raises(SignatureError):
        verify_note(parse_note(bad), [Verifier.from_vkey(GO_VKEY)])


@pytest.mark.parametrize(
    "bad",
    [
        GO_NOTE.rstrip("\n"),  # no final newline
        GO_TEXT,  # no signature block
        GO_NOTE.replace("— ", "- "),  # not an em dash
        GO_NOTE.replace("\n\n", "\n\x01\n\n"),  # control character
        GO_NOTE.replace("PeterNeumann ", "Peter+Neumann "),
        GO_NOTE.replace("x08go/", "x08go*"),  # not base64
        GO_NOTE.encode()[:-3] + b"\xff\n",
    ],
)
def test_malformed_notes(bad) -> None:
    with pytest.raises(DecodeError):
        parse_note(bad)


@pytest.mark.parametrize(
    "vkey",
    [
        GO_VKEY.replace("c74f20a3", "c74f20a4"),
        GO_VKEY.replace("+ARpc", "+AhRpc"),
        "PeterNeumann+c74f20a3",
        GO_VKEY[:-4],
    ],
)
def test_bad_vkeys(vkey: str) -> None:
    with pytest.raises(VerificationError):
        Verifier.from_vkey(vkey)


def test_cosignature_v1_roundtrip() -> None:
    key = SigningKey.from_seed(b"\x09" * 32)
    witness = Signer("witness.example/w1", key, ALG_COSIGNATURE_V1)
    assert witness.verifier.key_id == key_id("witness.example/w1", 4, key.public.raw)
    text = "example.com/log\n3\n" + base64.b64encode(b"\x00" * 32).decode() + "\n"
    note = sign_note(text, [witness], timestamp=1_700_000_000)
    parsed = parse_note(note.to_text())
    assert len(parsed.signatures[0].payload) == 72
    vk = Verifier.from_vkey(witness.verifier.vkey())
    assert verify_note(parsed, [vk])
    assert vk.check(parsed.text, parsed.signatures[0]) == 1_700_000_000
    # the Ed25519 verifier of the same key and name does not accept a cosignature
    with pytest.raises(SignatureError):
        verify_note(parsed, [Verifier("witness.example/w1", 1, key.public)])
