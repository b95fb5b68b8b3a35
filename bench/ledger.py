"""Ledger benchmark: append throughput, proof cost at 10^6 entries, audit speed.

Prints progress on stderr and one JSON object on the last line of stdout.
Ratios compare against baselines measured in the same run: batched appends
vs one-entry transactions, and proof generation vs a bare SHA-256 of the
same number of nodes.

    python bench/ledger.py [--entries 1000000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger import merkle  # noqa: E402
from ledger.audit import verify_ledger  # noqa: E402
from ledger.log import Ledger  # noqa: E402
from ledger.records import ContributorRegistered, VerdictRecorded  # noqa: E402
from ledger.storage import open_store  # noqa: E402
from verify.errors import Reason  # noqa: E402
from verify.keys import SigningKey  # noqa: E402

KEY = SigningKey.from_seed(b"\x42" * 32)
CONTRIBUTORS = [i.to_bytes(2, "big") * 16 for i in range(1, 257)]


def _leaf(ledger: Ledger, index: int) -> bytes:
    """The leaf hash of entry ``index``, which the ledger must hold."""
    entry = ledger.store.entry(index)
    if entry is None:
        raise RuntimeError(f"the ledger has no entry {index}")
    return entry[0]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def records(start: int, n: int) -> list:
    """Realistic verdicts over 256 contributors: a quarter audited, 1% failing."""
    out = []
    for i in range(start, start + n):
        c = CONTRIBUTORS[i % len(CONTRIBUTORS)]
        env = hashlib.sha256(i.to_bytes(8, "big")).digest()
        fail = i % 100 == 0
        out.append(
            VerdictRecorded(
                c,
                env[:16],
                i % 8,
                env,
                not fail,
                Reason.LOGPROB_MISMATCH.value if fail else "",
                (i // 256) % 4 == 0 or fail,
                env if fail else b"",
                1_700_000_000_000 + i,
            )
        )
    return out


def fill(ledger: Ledger, total: int, batch: int) -> float:
    """Append ``total`` records in ``batch``-sized transactions; return appends per second."""
    done, elapsed = 0, 0.0
    while done < total:
        n = min(batch, total - done)
        recs = records(done, n)
        t0 = time.perf_counter()
        ledger.append_many(recs)
        elapsed += time.perf_counter() - t0
        done += n
        if done % 100_000 == 0:
            log(f"  appended {done}")
    return total / elapsed


def bench_appends(tmp: Path, batch: int) -> dict:
    ledger = Ledger.open(tmp / "appends.db", signing_key=KEY, origin="bench/appends")
    ledger.append_many([ContributorRegistered(c, "c", 0) for c in CONTRIBUTORS])
    batched = fill(ledger, 50_000, batch)
    single_n = 300
    t0 = time.perf_counter()
    for rec in records(10**7, single_n):
        ledger.append(rec)
    single = single_n / (time.perf_counter() - t0)
    ledger.close()
    return {
        "appends_per_s_batched": round(batched),
        "appends_per_s_single": round(single),
        "batched_vs_single_ratio": round(batched / single, 1),
        "batch": batch,
    }


def bench_proofs(ledger: Ledger, size: int, samples: int = 2000) -> dict:
    rng = random.Random(1)
    cp = ledger.checkpoint().checkpoint
    indices = [rng.randrange(size) for _ in range(samples)]
    t0 = time.perf_counter()
    proofs = [ledger.inclusion_proof(i, size) for i in indices]
    gen = (time.perf_counter() - t0) / samples
    leaves = [_leaf(ledger, i) for i in indices]
    t0 = time.perf_counter()
    for i, leaf, proof in zip(indices, leaves, proofs, strict=True):
        merkle.verify_inclusion(i, size, leaf, proof, cp.root)
    ver = (time.perf_counter() - t0) / samples
    hashes = sum(len(p) for p in proofs) / samples
    t0 = time.perf_counter()
    for _ in range(samples):
        for _ in range(int(hashes)):
            hashlib.sha256(b"\x01" + b"\x00" * 64).digest()
    sha = (time.perf_counter() - t0) / samples
    t0 = time.perf_counter()
    tlog = ledger.prove(indices[0])
    prove_full = time.perf_counter() - t0
    return {
        "proof_gen_ms": round(gen * 1e3, 4),
        "proof_verify_ms": round(ver * 1e3, 4),
        "proof_hashes": round(hashes, 1),
        "proof_gen_vs_sha256_path_ratio": round(gen / sha, 1),
        "tlog_proof_ms": round(prove_full * 1e3, 3),
        "tlog_proof_bytes": len(tlog.to_text()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prooftrain-bench-") as d:
        tmp = Path(d)
        log("appends (50k, batched) ...")
        result = bench_appends(tmp, args.batch)
        log(f"  {result}")
        log(f"building a ledger of {args.entries} entries ...")
        big = Ledger.open(tmp / "big.db", signing_key=KEY, origin="bench/big")
        big.append_many([ContributorRegistered(c, "c", 0) for c in CONTRIBUTORS])
        t0 = time.perf_counter()
        fill(big, args.entries - big.size(), 50_000)
        build = time.perf_counter() - t0
        size = big.size()
        result.update(
            entries=size,
            build_s=round(build, 1),
            db_mib=round(os.path.getsize(tmp / "big.db") / 2**20, 1),
        )
        log("proofs ...")
        result.update(bench_proofs(big, size))
        big.close()
        log("audit ...")
        store = open_store(str(tmp / "big.db"), readonly=True)
        report = verify_ledger(store)
        store.close()
        if not report.ok:
            raise SystemExit(f"audit failed: {report.findings[0]}")
        result.update(
            audit_s=round(report.seconds, 2),
            audit_s_per_1e5=round(report.seconds * 1e5 / size, 3),
            audit_s_per_1e6_projected=round(report.seconds * 1e6 / size, 1),
            audit_contributors=report.contributors,
        )
    result["targets_met"] = {
        "appends_per_s>=5000": result["appends_per_s_batched"] >= 5000,
        "proof_gen<1ms": result["proof_gen_ms"] < 1.0,
        "audit_1e6<60s": result["audit_s_per_1e6_projected"] < 60.0,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
