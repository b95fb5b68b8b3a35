"""``prooftrain audit``: check a ledger offline, from public keys alone."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ledger.audit import parse_verifier, verify_ledger
from ledger.blob_audit import check_blob_references
from ledger.blobs import FileBlobStore
from ledger.lookup import check_proof_text, contributor_report, find_entry, prove_entry
from ledger.note import Verifier
from ledger.storage import open_store, storage_errors
from verify.errors import ConfigError, LedgerError, ProofTrainError, Reason


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit",
        help="verify a ledger, a contributor's history or an inclusion proof offline",
        description="Offline audit of a prooftrain ledger (a SQLite file or a postgresql:// DSN).",
    )
    p.set_defaults(_parser=p)
    sub = p.add_subparsers(dest="audit_command", metavar="ACTION")

    v = sub.add_parser(
        "verify",
        help="recompute the tree, checkpoints and reputation",
        description="Recompute the Merkle tree from the entries, check every "
        "checkpoint signature and consistency, replay reputation, and report the "
        "first discrepancy. Exit 0 when everything verifies, 1 otherwise.",
    )
    v.add_argument("ledger", help="ledger file or postgresql:// DSN")
    _keys(v, required=False)
    v.add_argument(
        "--blobs",
        help="blob directory: every blob the log references must be there, of its size "
        "and digest (default: LEDGER.blobs when it exists)",
    )
    v.add_argument("--json", action="store_true", help="print the full report as JSON")
    v.set_defaults(func=run_verify)

    c = sub.add_parser(
        "contributor",
        help="a contributor's history, score, ban and slash evidence",
        description="Print a summary of a contributor's record (reputation score, audit "
        "rate, ban status; verdicts accepted and rejected by reason, audited, slashes) and the "
        "evidence behind every slash; --history lists every entry.",
    )
    c.add_argument("ledger")
    c.add_argument("key", help="the contributor's public key (64 hex digits)")
    c.add_argument("--blobs", help="blob directory (default: LEDGER.blobs)")
    c.add_argument("--history", action="store_true", help="list every entry after the summary")
    c.add_argument("--json", action="store_true", help="the summary and every entry as JSON")
    c.set_defaults(func=run_contributor)

    pr = sub.add_parser(
        "prove",
        help="write a c2sp tlog-proof for one entry",
        description="Write a self-contained c2sp.org/tlog-proof@v1 file for the "
        "entry named by DIGEST (its leaf hash, or an envelope, manifest or "
        "evidence digest it records).",
    )
    pr.add_argument("ledger")
    pr.add_argument("digest", help="64 hex digits, or #INDEX (#-1: the last entry)")
    pr.add_argument("--out", required=True, help="proof file to write")
    pr.set_defaults(func=run_prove)

    k = sub.add_parser(
        "check-proof",
        help="verify a tlog-proof file without the ledger",
        description="Verify a c2sp.org/tlog-proof@v1 file against the log's public "
        "key: checkpoint signature(s), then the entry's inclusion.",
    )
    k.add_argument("proof", help="proof file")
    _keys(k, required=True)
    k.add_argument("--quorum", type=int, default=0, help="witness cosignatures required")
    k.set_defaults(func=run_check_proof)


def _keys(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--key",
        required=required,
        help="the log's public key: a vkey (name+id+base64), a file holding one, or "
        "64 hex digits (named by the checkpoint origin)",
    )
    p.add_argument(
        "--witness", action="append", default=[], help="a trusted witness vkey (repeatable)"
    )


def _read_key(value: str | None, origin: str | None) -> Verifier | None:
    if value is None:
        return None
    text = value
    if "+" not in value and not _is_hex_key(value):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ProofTrainError(f"cannot read key file {value}: {exc.strerror}") from None
    return parse_verifier(text, origin)


def _is_hex_key(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value)


def _blobs(args: argparse.Namespace) -> FileBlobStore | None:
    if args.blobs:
        if not Path(args.blobs).is_dir():
            raise ConfigError(f"--blobs {args.blobs} is not a directory")
        return FileBlobStore(args.blobs)
    default = Path(str(args.ledger).removeprefix("sqlite:") + ".blobs")
    return FileBlobStore(default) if "://" not in args.ledger and default.is_dir() else None


def _origin(store) -> str | None:  # noqa: ANN001
    return store.meta().get("origin")


def run_verify(args: argparse.Namespace) -> int:
    from rollout.progress import progress  # noqa: PLC0415

    store = open_store(args.ledger, readonly=True)
    try:
        log_key = _read_key(args.key, _safe_origin(store))
        witnesses = [parse_verifier(w) for w in args.witness]
        total = _safe_size(store)
        blobs = _blobs(args)
        with progress(
            total, "verifying", "entries", enabled=not args.json and total >= 50_000
        ) as bar:

            def advance(entries: int) -> None:
                bar.update(entries - bar.n)

            report = verify_ledger(
                store, log_key=log_key, witnesses=witnesses, blobs=blobs, progress=advance
            )
        try:
            check_blob_references(store, blobs, report)
        except storage_errors():  # an unreadable store: verify_ledger has reported it
            pass
    finally:
        store.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for warning in report.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if report.ok:
            print(
                f"ok: {report.size} entries, {report.checkpoints} checkpoints, "
                f"{report.contributors} contributors, {report.draws_checked} audit draws "
                f"verified in {report.seconds:.2f}s"
            )
        else:
            first = report.findings[0]
            print(f"FAILED: first discrepancy at {first}")
            for other in report.findings[1:20]:
                print(f"  also: {other}")
            if len(report.findings) > 20:
                print(f"  ... and {len(report.findings) - 20} more")
    return 0 if report.ok else 1


def _safe_origin(store) -> str | None:  # noqa: ANN001
    try:
        return _origin(store)
    except storage_errors():  # an unreadable store is reported by the audit itself
        return None


def _safe_size(store) -> int:  # noqa: ANN001
    try:
        return store.size()
    except storage_errors():
        return 0


def run_contributor(args: argparse.Namespace) -> int:
    try:
        key = bytes.fromhex(args.key)
    except ValueError:
        raise ProofTrainError("KEY must be a public key in hex") from None
    store = open_store(args.ledger, readonly=True)
    try:
        report = contributor_report(store, key, _blobs(args))
    finally:
        store.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for line in summary_lines(report):
        print(line)
    if args.history:
        print("history:")
        for item in report["history"]:
            fields = ", ".join(f"{k}={v}" for k, v in item.items() if k not in ("index", "type"))
            print(f"  #{item['index']} {item['type']}: {fields}")
    elif report["history"]:
        print(f"  (--history lists all {report['entries']} entries)")
    for s in report["slashes"]:
        verified = {True: "verified", False: "BAD", None: "not checked"}[s["evidence_verified"]]
        print(f"  slash #{s['index']} [{s['reason']}] {s['detail']}")
        print(
            f"    evidence {s['evidence_digest']} ({s['evidence_source']}, {verified}, "
            f"{s.get('evidence_bytes', '?')} bytes)"
        )
        if "evidence_hex" in s:
            print(f"    {s['evidence_hex'][:160]}")
    return 0


def summary_lines(report: dict) -> list[str]:
    """What a contributor's record comes to, before any entry: standing, verdicts, slashes."""
    summary = report["summary"]
    status = "BANNED" if report["banned"] else "active"
    score = "none" if report["score"] is None else f"{report['score']:.4f}"
    lines = [
        f"contributor {report['contributor']}: {status}, score {score}, "
        f"audit rate {report['audit_rate']:.3f}",
        f"  checks passed {report['passed']}, failed {report['failed']}, "
        f"slashed {report['slashed']}",
    ]
    rejected = ", ".join(f"{r} {n}" for r, n in summary["rejected_by_reason"].items())
    lines.append(
        f"  verdicts {summary['verdicts']}: accepted {summary['accepted']}, "
        f"rejected {summary['rejected']}" + (f" ({rejected})" if rejected else "")
    )
    lines.append(f"  audited {summary['audited']} (rejected {summary['audited_rejected']} of them)")
    slashes = ", ".join(f"{r} {n}" for r, n in summary["slashes_by_reason"].items())
    lines.append(f"  slashes {len(report['slashes'])}" + (f" ({slashes})" if slashes else ""))
    by_type = ", ".join(f"{t} {n}" for t, n in sorted(summary["entries_by_type"].items()))
    lines.append(f"  {report['entries']} ledger entries" + (f": {by_type}" if by_type else ""))
    if not report["stored_matches_replay"]:
        lines.append("  WARNING: stored reputation differs from the replay of the log")
    return lines


def run_prove(args: argparse.Namespace) -> int:
    store = open_store(args.ledger, readonly=True)
    try:
        if args.digest.startswith("#"):
            try:
                index = int(args.digest[1:])
            except ValueError:
                raise ProofTrainError("DIGEST must be 64 hex digits or #INDEX") from None
            if index < 0:  # counted from the end, as Python does: #-1 is the last entry
                index += store.size()
        else:
            try:
                digest = bytes.fromhex(args.digest)
            except ValueError:
                raise ProofTrainError("DIGEST must be 64 hex digits or #INDEX") from None
            if len(digest) != 32:
                raise LedgerError(
                    "a digest is 32 bytes", reason=Reason.MALFORMED, computed=len(digest)
                )
            index = find_entry(store, digest)
        proof = prove_entry(store, index)
    finally:
        store.close()
    Path(args.out).write_text(proof.to_text())
    print(
        f"wrote proof of entry {index} (tree size {proof.checkpoint.splitlines()[1]}) to {args.out}"
    )
    return 0


def run_check_proof(args: argparse.Namespace) -> int:
    try:
        text = Path(args.proof).read_bytes()
    except OSError as exc:
        raise ProofTrainError(f"cannot read {args.proof}: {exc.strerror}") from None
    origin = text.split(b"\n\n", 1)[-1].split(b"\n", 1)[0].decode("utf-8", "replace") or None
    log = _read_key(args.key, origin)
    assert log is not None
    witnesses = [parse_verifier(w) for w in args.witness]
    result = check_proof_text(text, log, witnesses, args.quorum)
    print(json.dumps(result, indent=2))
    return 0
