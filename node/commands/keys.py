"""``prooftrain keys``: create and inspect Ed25519 identity files."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from verify.errors import KeyFileError, Reason
from verify.keys import (
    PASSPHRASE_ENV,
    SigningKey,
    is_encrypted,
    load_signing_key,
    save_signing_key,
    write_public_key,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser(
        "keys",
        help="create and inspect Ed25519 identity keys",
        description="Create and inspect Ed25519 identity keys. Passphrases are read from "
        f"${PASSPHRASE_ENV} or prompted for; they are never accepted on the command line.",
    )
    keys.set_defaults(_parser=keys)
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION")

    new = sub.add_parser(
        "new",
        help="generate a key; writes FILE (0600) and FILE.pub",
        description="Generate an Ed25519 key. The private key goes to FILE with mode 0600 "
        "(never overwriting an existing file); the public key, as hex, to FILE.pub.",
    )
    new.add_argument("--out", required=True, type=Path, help="private key file to create")
    new.add_argument(
        "--encrypt",
        action="store_true",
        help=f"encrypt with a passphrase from ${PASSPHRASE_ENV} or a prompt",
    )
    new.set_defaults(func=cmd_new)

    show = sub.add_parser(
        "show",
        help="print a key file's public key and fingerprint",
        description="Print the public key and fingerprint of a key file. "
        "The private key is never printed.",
    )
    show.add_argument("file", type=Path, help="private key file")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_show)


def read_passphrase(confirm: bool = False) -> bytes:
    """Passphrase from the environment, else an interactive prompt."""
    env = os.environ.get(PASSPHRASE_ENV)
    if env:
        return env.encode()
    if not sys.stdin.isatty():
        raise KeyFileError(
            f"no passphrase: set {PASSPHRASE_ENV} or run interactively", Reason.BAD_PASSPHRASE
        )
    first = getpass.getpass("passphrase: ")
    if confirm and getpass.getpass("repeat passphrase: ") != first:
        raise KeyFileError("passphrases do not match", Reason.BAD_PASSPHRASE)
    if not first:
        raise KeyFileError("empty passphrase", Reason.BAD_PASSPHRASE)
    return first.encode()


def load_key_file(path: Path) -> SigningKey:
    """Load a key file, asking for the passphrase only when it is encrypted."""
    if not path.exists():
        raise KeyFileError(f"no key file at {path}")
    passphrase = read_passphrase() if is_encrypted(path) else None
    return load_signing_key(path, passphrase)


def cmd_new(args: argparse.Namespace) -> int:
    passphrase = read_passphrase(confirm=True) if args.encrypt else None
    key = SigningKey.generate()
    save_signing_key(key, args.out, passphrase)
    pub = write_public_key(key.public, Path(f"{args.out}.pub"))
    print(f"wrote private key {args.out} (mode 0600{', encrypted' if passphrase else ''})")
    print(f"wrote public key  {pub}")
    print(f"public key  {key.public.hex()}")
    print(f"fingerprint {key.public.fingerprint}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    key = load_key_file(args.file)
    info = {
        "file": str(args.file),
        "public_key": key.public.hex(),
        "fingerprint": key.public.fingerprint,
        "encrypted": is_encrypted(args.file),
    }
    if args.json:
        print(json.dumps(info))
    else:
        for name, value in info.items():
            print(f"{name:12} {value}")
    return 0
