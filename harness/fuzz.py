"""A time-boxed fuzz campaign over every decoder and every endpoint of the validator.

Each round picks a target, builds a valid input for it, mutates it (bit flips,
byte substitutions, truncation, trailing garbage, splices, length-prefix
inflation, pure random bytes) and feeds it in. A decoder passes when it either
parses or raises a ``ProofTrainError`` (a typed rejection); anything else is a
crash and is reported with its reproducer. The HTTP targets post to a live
node on 127.0.0.1 and pass when the status is below 500 and the node still
answers ``/healthz``; at the end the node's ledger must pass ``audit verify``.
A share of the time (``--openapi-share``, a third by default) goes to the
schema-driven campaign of ``harness.fuzz_openapi`` against the same validator.

    python -m harness.fuzz --seconds 600      (make fuzz)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from verify.errors import ProofTrainError
from verify.keys import SigningKey
from verify.signed import open_group_verdict, seal

if TYPE_CHECKING:
    from node.validator.core import Validator
    from verify.types import GroupSubmission

VALIDATOR_SEED = b"\x21" * 32
"""The campaign's validator key (the answers the contributor-side target opens are its)."""


def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    op = rng.randrange(8)
    if op == 0 and buf:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf) * 8)
            buf[i // 8] ^= 1 << (i % 8)
    elif op == 1 and buf:
        buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif op == 2:
        buf = buf[: rng.randrange(len(buf) + 1)]
    elif op == 3:
        buf += rng.randbytes(rng.randint(1, 64))
    elif op == 4 and len(buf) > 2:
        a, b = sorted(rng.sample(range(len(buf)), 2))
        buf = buf[:a] + buf[b:] + buf[a:b]
    elif op == 5 and buf:  # msgpack length prefixes: make something claim to be huge
        i = rng.randrange(len(buf))
        buf[i : i + 1] = bytes([rng.choice([0xC6, 0xDB, 0xDD, 0xDF])]) + b"\xff\xff\xff\xf0"
    elif op == 6:
        return rng.randbytes(rng.randint(0, 512))
    else:
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = rng.randbytes(rng.randint(1, 16))
    return bytes(buf)


def decoder_targets(seeds: dict[str, bytes]) -> dict[str, Callable[[bytes], object]]:
    from ledger.checkpoint import Checkpoint
    from ledger.note import parse_note
    from ledger.records import decode_record
    from verify import types as T
    from verify.envelope import verify_envelope
    from verify.weights_codec import DecodeLimits, decode_delta, decode_state_delta

    limits = DecodeLimits()
    targets: dict[str, Callable[[bytes], object]] = {
        "envelope": verify_envelope,
        "ledger-record": decode_record,
        "weight-delta": lambda b: decode_delta(b, limits),
        "state-delta": lambda b: decode_state_delta(b, limits),
        "signed-note": lambda b: parse_note(b.decode("utf-8", "replace")),
        "checkpoint": lambda b: Checkpoint.from_text(b.decode("utf-8", "replace")),
    }
    for name in (
        "RolloutHeader",
        "GroupSubmission",
        "WorkAssignment",
        "SignedManifest",
        "PolicyManifest",
        "SampleBatch",
        "SlashEvidence",
        "GroupVerdict",
        "SignedGroupVerdict",
    ):
        cls = getattr(T, name)
        targets[name] = partial(T.decode, cls, max_bytes=1 << 20)
    validator = SigningKey.from_seed(VALIDATOR_SEED).public
    targets["open-group-verdict"] = lambda b: (
        open_group_verdict(  # what a contributor runs on an answer
            T.decode(T.SignedGroupVerdict, b, max_bytes=1 << 20), validator
        )
    )
    return {k: v for k, v in targets.items() if k in seeds}


def build_seeds(
    work: Path,
) -> tuple[dict[str, bytes], tuple[Validator, GroupSubmission, SigningKey]]:
    """Valid inputs for every target, and a live validator (tiny random model)."""
    import numpy as np
    import torch

    from harness.tiny_model import build_tiny_model
    from ledger.records import Note
    from ledger.records import canonical_bytes as record_bytes
    from verify import types as T
    from verify.weights_codec import encode_state_delta, get_codec

    model = build_tiny_model(work / "model")
    from ledger.log import Ledger
    from node.config import ValidatorConfig, load
    from node.validator.core import Validator
    from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
    from node.validator.state import StateStore
    from rewards.tasks.base import generate
    from rollout.backends import TransformersBackend
    from rollout.oracle import TransformersOracle
    from rollout.worker import answer, open_assignment
    from verify.spotcheck import FLOAT32_TOLERANCE

    key = SigningKey.from_seed(VALIDATOR_SEED)
    cfg = load(
        ValidatorConfig,
        None,
        {
            "assignment.max_tokens": 8,
            "rules.audit_rate": 1.0,
            "assignment.max_outstanding": 1_024,
            "limits.requests_per_s": 1e6,
            "limits.burst": 1_000_000,
        },
    )
    ledger = Ledger.open(work / "ledger.sqlite", signing_key=key, origin="fuzz")
    codec = HFTextCodec(model)
    v = Validator(
        cfg,
        key,
        ledger,
        StateStore(work / "state.sqlite"),
        codec,
        TransformersOracle({0: model}),
        generate("arithmetic", "train", 4096),
        PolicyVersions(model_dir_digest(model)),
        FLOAT32_TOLERANCE,
    )
    alice = SigningKey.from_seed(b"\x22" * 32)
    v.register(alice.public.raw, "alice")
    group = answer(alice, v.assign(alice.public.raw), key.public, TransformersBackend(model), codec)
    delta = {"w": torch.from_numpy(np.random.default_rng(0).normal(size=(64,)).astype("float32"))}
    batch = v.samples(0)
    a = open_assignment(v.assign(alice.public.raw), key.public, alice.public)
    answered = seal(
        key,
        T.GroupVerdict(
            b"\x00" * 32,
            [
                T.Verdict(
                    T.SCHEMA_VERSION,
                    key.public.raw,
                    a.assignment_id,
                    i,
                    bytes([i]) * 32,
                    i > 0,
                    "" if i else "logprob_mismatch",
                    0.5,
                    i == 0,
                    b"" if i else b"\x01" * 32,
                    1,
                )
                for i in range(4)
            ],
        ),
    )
    seeds = {
        "envelope": T.canonical_bytes(group.envelopes[0]),
        "GroupSubmission": T.canonical_bytes(group),
        "RolloutHeader": group.envelopes[0].header,
        "WorkAssignment": v.assign(alice.public.raw).assignment,
        "SampleBatch": T.canonical_bytes(batch),
        "GroupVerdict": answered.group_verdict,  # type: ignore[attr-defined]
        "SignedGroupVerdict": T.canonical_bytes(answered),
        "open-group-verdict": T.canonical_bytes(answered),
        "ledger-record": record_bytes(Note("fuzz", 1)),
        "weight-delta": get_codec("int8-block").encode(delta["w"]),
        "state-delta": encode_state_delta(delta, get_codec("topk")),
        "signed-note": (ledger.checkpoint().to_text()).encode(),
        "checkpoint": ledger.checkpoint().to_text().split("\n\n")[0].encode() + b"\n",
    }
    return seeds, (v, group, alice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="campaign length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--openapi-share",
        type=float,
        default=1 / 3,
        help="fraction of the time for the OpenAPI (schemathesis) campaign; 0 skips it",
    )
    args = parser.parse_args(argv)
    import httpx

    from ledger.audit import verify_ledger
    from node.validator.auth import sign_request
    from node.validator.server import BackgroundServer
    from node.validator.service import create_app

    rng = random.Random(args.seed)
    tried: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    crashes: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        seeds, (v, group, alice) = build_seeds(Path(tmp))
        targets = decoder_targets(seeds)
        endpoints = [
            ("POST", "/v1/submit"),
            ("POST", "/v1/register"),
            ("POST", "/v1/assign"),
            ("POST", "/v1/policy"),
            ("POST", "/v1/blobs"),
            ("GET", "/v1/samples"),
            ("GET", "/v1/policy/0"),
            ("GET", "/v1/blobs/" + "00" * 32),
        ]
        http_seed = seeds["GroupSubmission"]
        with (
            BackgroundServer(create_app(v, alice.public)) as url,
            httpx.Client(base_url=url) as client,
        ):
            deadline = time.monotonic() + args.seconds * (1 - args.openapi_share)
            last = time.monotonic()
            while time.monotonic() < deadline:
                if rng.random() < 0.25:
                    method, path = rng.choice(endpoints)
                    body = mutate(http_seed, rng)
                    headers = (
                        sign_request(alice, method, path, body, time.time_ns() // 1_000_000)
                        if rng.random() < 0.5
                        else {}
                    )
                    name = f"http {method} {path.split('/')[2]}"
                    tried[name] += 1
                    r = client.request(method, path, content=body, headers=headers)
                    if r.status_code >= 500:
                        crashes.append(
                            {"target": name, "status": r.status_code, "input": body.hex()[:400]}
                        )
                    elif r.status_code >= 400:
                        rejected[name] += 1
                else:
                    name = rng.choice(sorted(targets))
                    data = mutate(seeds[name], rng)
                    tried[name] += 1
                    try:
                        targets[name](data)
                    except ProofTrainError:
                        rejected[name] += 1
                    except Exception:  # noqa: BLE001 - the campaign's whole point is to find these
                        crashes.append(
                            {
                                "target": name,
                                "input": data.hex()[:400],
                                "error": traceback.format_exc(limit=3),
                            }
                        )
                if time.monotonic() - last > 30:
                    last = time.monotonic()
                    print(
                        f"fuzz: {sum(tried.values())} inputs, {len(crashes)} crashes",
                        file=sys.stderr,
                    )
            healthy = client.get("/healthz").status_code == 200
        openapi = None
        if args.openapi_share > 0:
            from harness.fuzz_openapi import fuzz_validator, summarize

            tally, api_healthy = fuzz_validator(
                v, alice, args.seconds * args.openapi_share, seeds, args.seed
            )
            openapi = summarize(tally, api_healthy, True, args.seconds * args.openapi_share)
            healthy = healthy and api_healthy
        audit = verify_ledger(v.ledger.store, blobs=v.ledger.blobs)
        v.ledger.close()
        v.state.close()
    result = {
        "seconds": args.seconds,
        "inputs": sum(tried.values()),
        "per_target": dict(tried),
        "rejected": dict(rejected),
        "crashes": len(crashes),
        "node_healthy": healthy,
        "ledger_audit_ok": audit.ok,
        "first_crashes": crashes[:5],
        "openapi": openapi,
    }
    print(json.dumps(result))
    openapi_ok = openapi is None or (
        openapi["failures"] == 0
        and openapi["server_errors"] == 0
        and openapi["operations_exercised"] == openapi["operations"]
    )
    return 0 if not crashes and healthy and audit.ok and openapi_ok else 1


if __name__ == "__main__":
    sys.exit(main())
