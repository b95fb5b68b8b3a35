"""Schema-driven fuzzing of every operation the validator declares in ``/openapi.json``.

schemathesis reads the live node's spec and generates requests for each
operation: path and query parameters, JSON bodies and binary (msgpack) bodies
within the declared types and bounds (positive mode) and outside them
(negative mode). Binary bodies are also drawn from byte-level mutations of a
valid seed (a real ``GroupSubmission`` or ``SignedManifest``), so the decoders
behind the endpoints see near-valid input, not only noise.

Every operation runs under three callers, because a fuzzer that never signs
only ever reaches the 401 path:

    anon          headers as generated (none, or garbage signature headers)
    contributor   Ed25519-signed by a key registered with the validator
    trainer       signed by the trainer key the node was started with

Pass criteria, all checked per response or at the end:

1. no 5xx, ever (schemathesis ``not_a_server_error``);
2. status codes, content types and JSON bodies as the spec declares them
   (``status_code_conformance``, ``content_type_conformance``,
   ``response_schema_conformance``), and schema-violating input is refused
   with a 4xx (``negative_data_rejection``);
3. a signed endpoint never answers 2xx to ``anon``, and a trainer-only
   endpoint never answers 2xx to ``contributor``;
4. the node still answers ``/healthz`` and its ledger passes ``verify_ledger``.

Each distinct failure (operation, caller, check) is reported once, with a count
and a curl reproducer of its first occurrence.

    python -m harness.fuzz_openapi --seconds 600
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException, Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from harness.fuzz import mutate
from node.validator.auth import KEY_HEADER, SIG_HEADER, TIME_HEADER, sign_request
from verify.keys import SigningKey

schemathesis.serializer.alias("application/msgpack", "application/octet-stream")

CALLERS = ("anon", "contributor", "trainer")
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# A body replaced by a seed mutation is not schemathesis-generated: its positive/negative label is meaningless.
SEEDED_CHECKS = [check for check in CHECKS if check is not negative_data_rejection]
# Endpoints whose handler admits the trainer key only (node/validator/service.py, ``trainer_only``).
TRAINER_ONLY = {"POST /v1/policy", "POST /v1/trainer/eval", "POST /v1/blobs", "GET /v1/samples"}
# Valid bodies that mutated copies are drawn from, by operation label.
SEED_OF = {
    "POST /v1/submit": "GroupSubmission",
    "POST /v1/policy": "SignedManifest",
    "POST /v1/blobs": "GroupSubmission",
}
PROGRESS_EVERY_S = 30.0


class SigningSession(requests.Session):
    """A session that signs every request it sends as ``key`` (or leaves it as generated if None).

    Signing happens on the prepared request, so it covers exactly the bytes on
    the wire: method, path with query, and the serialized body.
    """

    def __init__(self, key: SigningKey | None) -> None:
        super().__init__()
        self.key = key

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        if self.key is not None:
            body = request.body or b""
            body = body.encode() if isinstance(body, str) else body
            if not isinstance(body, (bytes, bytearray, memoryview)):
                raise TypeError(f"cannot sign a streamed request body ({type(body).__name__})")
            for name in (KEY_HEADER, TIME_HEADER, SIG_HEADER):
                request.headers.pop(name, None)
            request.headers.update(
                sign_request(
                    self.key,
                    request.method or "GET",
                    request.path_url,
                    bytes(body),
                    time.time_ns() // 1_000_000,
                )
            )
        return super().send(request, **kwargs)


@dataclass
class Tally:
    """What the campaign saw: inputs and statuses per operation, and distinct failures."""

    inputs: Counter[str] = field(default_factory=Counter)
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    failures: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    generation_errors: Counter[str] = field(default_factory=Counter)

    def fail(
        self, label: str, caller: str, check: str, status: int | None, detail: str, repro: str
    ) -> None:
        key = (label, caller, check)
        if key in self.failures:
            self.failures[key]["count"] += 1
            return
        self.failures[key] = {
            "operation": label,
            "caller": caller,
            "check": check,
            "status": status,
            "detail": detail[:600],
            "reproducer": repro[:2_000],
            "count": 1,
        }


def auth_violation(label: str, caller: str, signed: bool, status: int) -> str | None:
    """Why a 2xx answer to this caller breaks the access rules, or None."""
    if not 200 <= status < 300:
        return None
    if signed and caller == "anon":
        return "a signed endpoint accepted an unsigned request"
    if label in TRAINER_ONLY and caller == "contributor":
        return "a trainer-only endpoint accepted a contributor"
    return None


def negatable(raw: dict[str, Any], caller: str) -> bool:
    """Whether negative mode has anything to negate for this operation and caller.

    Any byte string is a valid binary body, and a signed caller's auth headers are
    fixed, so without parameters or a JSON body there is nothing to negate (and
    Hypothesis would spend seconds proving it).
    """
    content = raw.get("requestBody", {}).get("content", {})
    return (
        bool(raw.get("parameters"))
        or "application/json" in content
        or (caller == "anon" and bool(raw.get("security")))
    )


def _reproducer(case: schemathesis.Case, response: schemathesis.Response | None) -> str:
    """A curl command with the headers as sent; a signed one must be re-signed (120 s window) to replay."""
    headers = dict(response.request.headers) if response is not None else None
    try:
        return case.as_curl_command(headers=headers)
    except Exception as exc:  # noqa: BLE001 - a reproducer that cannot be printed must not end the campaign
        return f"<no curl command: {exc}>"


def _run_case(
    case: schemathesis.Case,
    label: str,
    caller: str,
    signed: bool,
    url: str,
    session: SigningSession,
    tally: Tally,
    seeded: bool = False,
) -> None:
    tally.inputs[label] += 1
    try:
        resp = case.call(base_url=url, session=session, timeout=30)
    except requests.RequestException as exc:
        tally.statuses[label][0] += 1
        tally.fail(label, caller, "transport", None, repr(exc), _reproducer(case, None))
        return
    status = resp.status_code
    tally.statuses[label][status] += 1
    why = auth_violation(label, caller, signed, status)
    if why:
        tally.fail(label, caller, "access_control", status, why, _reproducer(case, resp))
    try:
        case.validate_response(resp, checks=SEEDED_CHECKS if seeded else CHECKS)
    except FailureGroup as group:
        for failure in group.exceptions:
            tally.fail(
                label,
                caller,
                failure.title,
                status,
                f"{failure.title}: {failure.message}",
                _reproducer(case, resp),
            )


def _cell(
    op: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    caller: str,
    url: str,
    session: SigningSession,
    tally: Tally,
    seeds: dict[str, bytes],
    deadline: list[float],
    batch: int,
) -> Any:
    """One Hypothesis-driven loop over ``batch`` generated cases for (operation, mode, caller)."""
    label = f"{op.method.upper()} {op.path}"
    signed = bool(op.definition.raw.get("security"))
    seed_body = seeds.get(SEED_OF.get(label, ""))
    # A signed caller's auth headers are fixed (so never negated) and rewritten by ``session``.
    fixed = (
        {name: "0" for name in (KEY_HEADER, TIME_HEADER, SIG_HEADER)}
        if session.key is not None
        else None
    )
    strategy = op.as_strategy(generation_mode=mode, headers=fixed)

    @settings(
        max_examples=batch,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    # Everything is drawn up front (no lazy ``st.randoms``): an early return must not change the draws.
    @given(case=strategy, mutation=st.integers(0, 2**32 - 1), use_seed=st.booleans())
    def run(case: schemathesis.Case, mutation: int, use_seed: bool) -> None:
        if time.monotonic() > deadline[0]:
            return
        seeded = False
        if seed_body is not None and use_seed:
            case.body = mutate(seed_body, random.Random(mutation))
            seeded = True
        _run_case(case, label, caller, signed, url, session, tally, seeded)

    return run


def campaign(
    app: FastAPI,
    keys: dict[str, SigningKey | None],
    seconds: float,
    *,
    seeds: dict[str, bytes] | None = None,
    seed_value: int = 0,
    batch: int = 8,
    only: set[str] | None = None,
) -> tuple[Tally, bool]:
    """Fuzz every operation of ``app`` (served on 127.0.0.1) for ``seconds``; (tally, node still healthy).

    ``only`` restricts the campaign to these operation labels (``"GET /healthz"``).

    Every (operation, mode, caller) cell runs at least one batch, even past the deadline,
    so a short campaign still exercises every operation.
    """
    from node.validator.server import BackgroundServer

    tally = Tally()
    with BackgroundServer(app) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        ops: list[schemathesis.APIOperation] = []
        for result in schema.get_all_operations():
            if isinstance(result, Err):  # the node's own spec does not parse: nothing can be fuzzed
                raise result.err()
            op = result.ok()
            if only is None or f"{op.method.upper()} {op.path}" in only:
                ops.append(op)
        sessions = {caller: SigningSession(keys.get(caller)) for caller in CALLERS}
        no_deadline = [float("inf")]
        cells = [
            _cell(op, mode, caller, url, sessions[caller], tally, seeds or {}, no_deadline, batch)
            for op in ops
            for mode in MODES
            for caller in CALLERS
            if mode is MODES[0] or negatable(op.definition.raw, caller)
        ]
        start = last = time.monotonic()
        rounds = 0
        while cells and (rounds == 0 or time.monotonic() < start + seconds):
            for i, run in enumerate(list(cells)):
                try:
                    seed(seed_value * 1_000_003 + rounds * len(cells) + i)(run)()
                except Unsatisfiable:  # negative mode of an operation that takes no input
                    cells.remove(run)
                except HypothesisException as exc:  # generation trouble on our side, not the node's
                    tally.generation_errors[type(exc).__name__] += 1
                if rounds > 0 and time.monotonic() > start + seconds:
                    break
                if time.monotonic() - last > PROGRESS_EVERY_S:
                    last = time.monotonic()
                    print(
                        f"fuzz-openapi: {sum(tally.inputs.values())} inputs over {len(tally.inputs)} operations, "
                        f"{len(tally.failures)} distinct failures",
                        file=sys.stderr,
                    )
            rounds += 1
            no_deadline[0] = start + seconds
        for session in sessions.values():
            session.close()
        try:
            healthy = requests.get(f"{url}/healthz", timeout=10).status_code == 200
        except requests.RequestException:
            healthy = False
    tally.inputs["operations"] = len(ops)
    return tally, healthy


def summarize(tally: Tally, healthy: bool, audit_ok: bool, seconds: float) -> dict[str, Any]:
    operations = tally.inputs.pop("operations", 0)
    failures = sorted(
        tally.failures.values(), key=lambda f: (f["operation"], f["caller"], f["check"])
    )
    return {
        "seconds": seconds,
        "operations": operations,
        "operations_exercised": len(tally.inputs),
        "inputs": sum(tally.inputs.values()),
        "per_operation": dict(tally.inputs),
        "statuses": {
            op: {str(k): v for k, v in sorted(c.items())} for op, c in tally.statuses.items()
        },
        "server_errors": sum(n for c in tally.statuses.values() for s, n in c.items() if s >= 500),
        "failures": len(failures),
        "generation_errors": dict(tally.generation_errors),
        "node_healthy": healthy,
        "ledger_audit_ok": audit_ok,
        "first_failures": failures[:10],
    }


def passed(summary: dict[str, Any]) -> bool:
    return (
        summary["failures"] == 0
        and summary["server_errors"] == 0
        and summary["node_healthy"]
        and summary["ledger_audit_ok"]
        and summary["operations_exercised"] == summary["operations"]
    )


def fuzz_validator(
    v: Any,
    contributor: SigningKey,
    seconds: float,
    seeds: dict[str, bytes],
    seed_value: int = 0,
    batch: int = 8,
) -> tuple[Tally, bool]:
    """Serve validator ``v`` with a fixed trainer key and fuzz it; ``contributor`` must be registered."""
    from node.validator.service import create_app

    trainer = SigningKey.from_seed(b"\x23" * 32)
    manifest = v.state.manifest(v.versions.current)
    seeds = {**seeds, **({"SignedManifest": manifest} if manifest is not None else {})}
    return campaign(
        create_app(v, trainer.public),
        {"anon": None, "contributor": contributor, "trainer": trainer},
        seconds,
        seeds=seeds,
        seed_value=seed_value,
        batch=batch,
    )


def run_on_fresh_node(seconds: float, seed_value: int = 0, batch: int = 8) -> dict[str, Any]:
    """Build a validator (tiny model, SQLite ledger in a temp dir), fuzz it, audit its ledger."""
    from harness.fuzz import build_seeds
    from ledger.audit import verify_ledger

    with tempfile.TemporaryDirectory() as tmp:
        seeds, (v, _group, alice) = build_seeds(Path(tmp))
        tally, healthy = fuzz_validator(v, alice, seconds, seeds, seed_value, batch)
        audit = verify_ledger(v.ledger.store, blobs=v.ledger.blobs)
        v.ledger.close()
        v.state.close()
    return summarize(tally, healthy, audit.ok, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="campaign length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch", type=int, default=8, help="cases per (operation, mode, caller) turn"
    )
    args = parser.parse_args(argv)
    summary = run_on_fresh_node(args.seconds, args.seed, args.batch)
    print(json.dumps(summary))
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
