"""Load test of a validator node: many concurrent contributors on 127.0.0.1.

``--contributors`` threads each register a key, then loop (bounded by
``--groups`` per contributor and ``--seconds`` overall): take an assignment,
generate an honest group with the demo model, submit it. Audits run at the
reputation-driven rate, so spot checks are part of the load. Afterwards it
checks, against the node's ledger, that every verdict a client was told is
recorded exactly as told (nothing accepted was lost, nothing rejected is
stored as accepted) and that the ledger passes ``audit verify``.

Prints one JSON object: sustained admissions per second, p50/p99 latency,
peak resident memory, counts and the consistency result.

    python -m harness.loadtest [--contributors 16] [--groups 20] [--seconds 120]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rollout.loading import model_dir_arg

if TYPE_CHECKING:
    from node.validator.core import Validator
    from node.validator.policy import HFTextCodec


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from trainer.base_model import ensure_base_model

    model = args.model or ensure_base_model("arithmetic", progress=False)
    tally = _Tally()
    with tempfile.TemporaryDirectory() as tmp:
        v, codec = _validator(Path(tmp), model, args.contributors)
        elapsed = _run_contributors(v, codec, model, args, tally)
        lost, wrongly_accepted, audit_ok = _check_ledger(v, tally.told)
        v.ledger.close()
        v.state.close()
    latencies = tally.latencies
    result = {
        "contributors": args.contributors,
        "seconds": round(elapsed, 2),
        "groups": len(latencies),
        "admissions_per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": round(1000 * float(np.percentile(latencies, 50)), 1) if latencies else None,
        "p99_ms": round(1000 * float(np.percentile(latencies, 99)), 1) if latencies else None,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rollouts_told": len(tally.told),
        "accepted_lost": len(lost),
        "rejected_stored_as_accepted": len(wrongly_accepted),
        "errors": tally.errors,
        "ledger_audit_ok": audit_ok,
    }
    print(json.dumps(result))
    return 0 if not lost and not wrongly_accepted and audit_ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contributors", type=int, default=16)
    parser.add_argument("--groups", type=int, default=20, help="groups per contributor at most")
    parser.add_argument("--seconds", type=float, default=120.0, help="wall-clock bound")
    parser.add_argument(
        "--model", type=model_dir_arg, default=None, help="model dir (default: the demo base model)"
    )
    return parser


@dataclass
class _Tally:
    """What the contributors were told, from all their threads (under ``lock``)."""

    told: dict[bytes, bool] = field(default_factory=dict)
    """Envelope digest -> accepted, as each verdict said."""
    latencies: list[float] = field(default_factory=list)
    """Seconds each answered submission took."""
    errors: dict[str, int] = field(default_factory=dict)
    """Refused requests by reason."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def _validator(work: Path, model: Path, contributors: int) -> tuple[Validator, HFTextCodec]:
    """A validator core over ``model`` with its ledger and state in ``work``, limits opened up."""
    from ledger.log import Ledger
    from node.config import ValidatorConfig, load
    from node.validator.core import Validator
    from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
    from node.validator.state import StateStore
    from rewards.tasks.base import generate
    from rollout.oracle import TransformersOracle
    from verify.keys import SigningKey
    from verify.spotcheck import FLOAT32_TOLERANCE

    key = SigningKey.from_seed(b"\x31" * 32)
    cfg = load(
        ValidatorConfig,
        None,
        {
            "assignment.max_tokens": 8,
            "audit.queue": 4 * contributors,
            "limits.requests_per_s": 1e4,
            "limits.burst": 10_000,
        },
    )
    codec = HFTextCodec(model)
    v = Validator(
        cfg,
        key,
        Ledger.open(work / "ledger.sqlite", signing_key=key, origin="load"),
        StateStore(work / "state.sqlite"),
        codec,
        TransformersOracle({0: model}),
        generate("arithmetic", "train", 10_000),
        PolicyVersions(model_dir_digest(model)),
        FLOAT32_TOLERANCE,
    )
    return v, codec


def _run_contributors(
    v: Validator, codec: HFTextCodec, model: Path, args: argparse.Namespace, tally: _Tally
) -> float:
    """Serve ``v`` on 127.0.0.1 and run the contributor threads against it until each is
    done or the deadline passes; returns the seconds they ran."""
    from node.client import ServiceError, ValidatorClient
    from node.validator.server import BackgroundServer
    from node.validator.service import create_app
    from rollout.backends import TransformersBackend
    from rollout.worker import answer
    from verify.envelope import group_digest
    from verify.keys import SigningKey
    from verify.signed import open_group_verdict
    from verify.types import canonical_bytes

    backend = TransformersBackend(model)
    gen_lock = threading.Lock()  # one model, one generation at a time
    deadline = time.monotonic() + args.seconds
    with BackgroundServer(create_app(v)) as url:

        def contributor(i: int) -> None:
            me = SigningKey.from_seed(bytes([100 + i % 150]) * 31 + bytes([i // 150]))
            client = ValidatorClient(url, me, retries=8)
            client.register(f"load-{i}")
            for _ in range(args.groups):
                if time.monotonic() > deadline:
                    break
                try:
                    sealed = client.assign()
                    with gen_lock:
                        group = canonical_bytes(answer(me, sealed, v.key.public, backend, codec))
                    start = time.perf_counter()
                    signed = client.submit(group)
                    took = time.perf_counter() - start
                except ServiceError as exc:
                    with tally.lock:
                        tally.errors[exc.reason.value] = tally.errors.get(exc.reason.value, 0) + 1
                    continue
                with tally.lock:
                    tally.latencies.append(took)
                    for verdict in open_group_verdict(signed, v.key.public, group_digest(group)):
                        tally.told[verdict.envelope_digest] = verdict.accepted
            client.close()

        threads = [
            threading.Thread(target=contributor, args=(i,)) for i in range(args.contributors)
        ]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - start


def _check_ledger(v: Validator, told: dict[bytes, bool]) -> tuple[list[bytes], list[bytes], bool]:
    """Each verdict a client was told against the ledger and the sample stream: the accepted
    rollouts lost, the rejected ones stored as accepted, and whether the ledger passes
    ``audit verify``."""
    from ledger.audit import verify_ledger
    from ledger.records import VerdictRecorded

    recorded = {
        rec.envelope_digest: rec.accepted
        for _, rec in v.ledger.entries()
        if isinstance(rec, VerdictRecorded)
    }
    served = _served(v)
    lost = [d for d, ok in told.items() if ok and (recorded.get(d) is not True or d not in served)]
    wrongly_accepted = [
        d for d, ok in told.items() if not ok and (recorded.get(d) is not False or d in served)
    ]
    return lost, wrongly_accepted, verify_ledger(v.ledger.store, blobs=v.ledger.blobs).ok


def _served(v: Validator) -> set[bytes]:
    """The envelope digests of every sample the node serves to the trainer."""
    served: set[bytes] = set()
    cursor = 0
    while True:
        page = v.samples(cursor, 4096)
        served |= {s.envelope_digest for s in page.samples}
        if page.next_cursor == cursor:
            return served
        cursor = page.next_cursor


if __name__ == "__main__":
    sys.exit(main())
