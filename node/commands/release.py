"""``prooftrain release``: build a verifiable release directory, or verify one offline."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from node.commands import model_dir_arg
from verify.errors import ConfigError, KeyFileError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "release",
        help="build a release of a trained policy, or verify one offline",
        description="Build a release directory of policy version V from a validator's ledger "
        "(and its blob store): the model (loadable with transformers), a trainer-signed release "
        "manifest, ledger inclusion proofs, the delta chain, the eval table and a model card. "
        "`prooftrain release verify DIR` checks such a directory offline.",
    )
    p.add_argument("--ledger", help="the validator's ledger (SQLite file or postgresql:// DSN)")
    p.add_argument(
        "--blobs",
        type=Path,
        help="its blob store, node.blob_dir (default: LEDGER.blobs; "
        "required for a PostgreSQL ledger)",
    )
    p.add_argument("--version", type=int, help="policy version (default: the latest published)")
    p.add_argument("--out", type=Path, help="release directory to create")
    p.add_argument("--base-model", type=model_dir_arg, help="the base model directory")
    p.add_argument("--trainer-key", type=Path, help="the trainer's private key file")
    p.add_argument("--eval-problems", type=int, default=300, help="problems per eval (default 300)")
    p.add_argument("-k", "--k", type=int, default=8, help="k of pass@k (default 8)")
    p.add_argument("--task", action="append", help="task to evaluate (default: the ledger's)")
    p.add_argument("--seed", type=int, default=0, help="eval problem and sampling seed")
    p.add_argument(
        "--no-chain",
        action="store_true",
        help="leave the base weights and update blobs out (verifiers pass them)",
    )
    p.set_defaults(func=run_build, _parser=p)
    sub = p.add_subparsers(dest="release_command", metavar="ACTION")
    v = sub.add_parser(
        "verify",
        help="verify a release directory offline",
        description="Check a release offline from the trainer's and the validator's public keys: "
        "signatures, the ledger checkpoint, every inclusion proof, the manifest chain from the "
        "base digest, a replay of the delta chain to the released weights, the safetensors, the "
        "eval table and the model card. Exit 0 when everything verifies, 1 with the first "
        "failure (file, reason, expected vs computed) otherwise.",
    )
    v.add_argument("directory", type=Path)
    v.add_argument("--trainer-key", required=True, help="trainer public key (hex or .pub file)")
    v.add_argument(
        "--validator-key", required=True, help="validator (log) public key (hex, .pub file or vkey)"
    )
    v.add_argument("--blobs", type=Path, help="update blobs to replay instead of DIR/chain/blobs")
    v.add_argument("--base-model", type=model_dir_arg, help="base model instead of DIR/chain/base")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=run_verify)


def _public(value: str):  # noqa: ANN202
    from ledger.note import Verifier
    from verify.keys import load_public_key

    text = value
    if "+" not in value and Path(value).is_file():
        text = Path(value).read_text().strip()
    if "+" in text:
        try:
            return Verifier.from_vkey(text).public
        except Exception as exc:  # noqa: BLE001  (any parse failure is a bad key argument)
            raise KeyFileError(f"not a vkey: {exc}") from None
    return load_public_key(value)


def run_build(args: argparse.Namespace) -> int:
    from node.commands.keys import load_key_file
    from trainer.release import build_release

    missing = [
        f"--{n.replace('_', '-')}"
        for n in ("ledger", "out", "base_model", "trainer_key")
        if getattr(args, n) is None
    ]
    if missing:
        raise ConfigError(f"release needs {', '.join(missing)} (or: prooftrain release verify DIR)")
    if "://" in args.ledger and args.blobs is None:
        raise ConfigError("a PostgreSQL ledger needs --blobs (the validator's node.blob_dir)")
    ledger = args.ledger if "://" in args.ledger else Path(args.ledger)  # a DSN is not a path
    out = build_release(
        ledger=ledger,
        out=args.out,
        base_model=args.base_model,
        trainer_key=load_key_file(args.trainer_key),
        version=args.version,
        eval_problems=args.eval_problems,
        k=args.k,
        blobs=args.blobs,
        tasks=args.task,
        seed=args.seed,
        ship_chain=not args.no_chain,
    )
    print(f"wrote release {out}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from ledger.release import ReleaseError, verify_release
    from verify.errors import VerificationError

    try:
        report = verify_release(
            args.directory,
            trainer_key=_public(args.trainer_key),
            validator_key=_public(args.validator_key),
            blobs=args.blobs,
            base_model=args.base_model,
        )
    except VerificationError as exc:
        if args.json:
            print(
                json.dumps(
                    {"ok": False, "file": getattr(exc, "file", None), **exc.to_dict()}, indent=2
                )
            )
        else:
            where = exc.file if isinstance(exc, ReleaseError) else str(args.directory)
            print(f"FAILED: {exc}")
            print(f"  file:     {where}")
            print(f"  reason:   {exc.reason.value}")
            if exc.expected is not None or exc.computed is not None:
                print(f"  expected: {exc.to_dict()['expected']}")
                print(f"  computed: {exc.to_dict()['computed']}")
        return 1
    if args.json:
        print(json.dumps({"ok": True, **asdict(report)}, indent=2))
    else:
        print(f"ok: release of policy version {report.version} verified in {report.seconds:.2f}s")
        print(f"  {report.files} files match the trainer-signed manifest")
        print(
            f"  checkpoint of size {report.checkpoint_size} signed by the validator; "
            f"{report.proofs} inclusion proofs verify"
        )
        print(f"  {report.verdicts} accepted verdicts proven before version {report.version}")
        print(f"  {report.evals} signed eval statements match the ledger, evals.json and README.md")
        print(
            f"  delta chain from base {report.base_digest[:16]}… replays to weights "
            f"{report.weights_digest[:16]}… = model.safetensors"
        )
    return 0
