"""The OpenAPI campaign exercises every declared operation cleanly, and reports a broken one."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import requests

from harness.fuzz import build_seeds
from harness.fuzz_openapi import SigningSession, auth_violation, campaign, passed, summarize
from ledger.audit import verify_ledger
from node.validator.auth import verify_request
from node.validator.service import create_app
from verify.errors import VerificationError
from verify.keys import SigningKey

TRAINER = SigningKey.from_seed(b"\x23" * 32)


@pytest.fixture(scope="module")
def node():
    with tempfile.TemporaryDirectory() as tmp:
        seeds, (v, _group, alice) = build_seeds(Path(tmp))
        yield v, seeds, {"anon": None, "contributor": alice, "trainer": TRAINER}
        v.ledger.close()
        v.state.close()


def test_short_campaign_covers_every_operation_without_server_errors(node) -> None:
    v, seeds, keys = node
    app = create_app(v, TRAINER.public)
    tally, healthy = campaign(app, keys, 6.0, seeds=seeds, batch=2)
    audit = verify_ledger(v.ledger.store, blobs=v.ledger.blobs)
    summary = summarize(tally, healthy, audit.ok, 6.0)
    assert summary["operations"] >= 12 and summary["operations_exercised"] == summary["operations"]
    assert summary["server_errors"] == 0 and summary["failures"] == 0, summary["first_failures"]
    assert summary["node_healthy"] and summary["ledger_audit_ok"] and passed(summary)
    statuses = summary["statuses"]
    # signed requests got past authentication: the contributor was assigned work, the trainer read samples
    assert (
        statuses["POST /v1/assign"].get("200", 0) > 0
        and statuses["GET /v1/samples"].get("200", 0) > 0
    )
    assert statuses["POST /v1/assign"].get("401", 0) > 0  # and unsigned ones did not
    assert all(n >= 2 for n in summary["per_operation"].values())


def test_a_broken_endpoint_is_reported(node) -> None:
    v, seeds, keys = node
    app = create_app(v, TRAINER.public)

    @app.get("/v1/broken/{n}")
    async def broken(n: int) -> dict[str, int]:
        if n % 2 == 0:
            raise RuntimeError("deliberate")
        return {"n": n}

    only = {"GET /v1/broken/{n}", "GET /healthz"}
    tally, healthy = campaign(app, keys, 0.0, seeds=seeds, batch=10, only=only)
    summary = summarize(tally, healthy, True, 0.0)
    assert not passed(summary)
    assert (
        summary["statuses"]["GET /v1/broken/{n}"].get("500", 0) > 0 and summary["server_errors"] > 0
    )
    failure = next(f for f in summary["first_failures"] if f["operation"] == "GET /v1/broken/{n}")
    assert failure["status"] == 500 and "/v1/broken/" in failure["reproducer"]
    assert summary["node_healthy"]


def test_access_rules() -> None:
    assert auth_violation("POST /v1/assign", "anon", True, 200)
    assert auth_violation("POST /v1/policy", "contributor", True, 200)
    assert auth_violation("POST /v1/policy", "trainer", True, 200) is None
    assert auth_violation("POST /v1/assign", "anon", True, 401) is None
    assert auth_violation("POST /v1/submit", "anon", False, 200) is None


def test_signing_session_signs_the_bytes_on_the_wire(monkeypatch) -> None:
    key = SigningKey.from_seed(b"\x24" * 32)
    target, body = "/v1/samples?cursor=3&limit=7", b"\x01\x02"
    prepared = requests.Request("POST", f"http://127.0.0.1:9{target}", data=body).prepare()
    sent: dict[str, str] = {}
    monkeypatch.setattr(
        requests.Session, "send", lambda self, request, **kw: sent.update(request.headers)
    )
    SigningSession(key).send(prepared)
    headers = {k.lower(): v for k, v in sent.items()}
    now = time.time_ns() // 1_000_000
    assert verify_request(headers, "POST", target, body, now) == key.public
    with pytest.raises(VerificationError):
        verify_request(headers, "POST", target.replace("7", "8"), body, now)


def test_spec_declares_bodies_bounds_and_signatures(node) -> None:
    v, _seeds, _keys = node
    spec = create_app(v, TRAINER.public).openapi()
    paths = spec["paths"]
    limit = v.cfg.limits.max_body_bytes
    for path, media in [
        ("/v1/submit", "application/msgpack"),
        ("/v1/policy", "application/msgpack"),
        ("/v1/trainer/eval", "application/msgpack"),
        ("/v1/blobs", "application/octet-stream"),
    ]:
        schema = paths[path]["post"]["requestBody"]["content"][media]["schema"]
        assert schema == {"type": "string", "format": "binary", "maxLength": limit}
    signed = {
        f"{m.upper()} {p}"
        for p, item in paths.items()
        for m, op in item.items()
        if op.get("security")
    }
    assert signed == {
        "POST /v1/register",
        "POST /v1/assign",
        "POST /v1/policy",
        "POST /v1/trainer/eval",
        "POST /v1/blobs",
        "GET /v1/samples",
    }
    assert set(spec["components"]["securitySchemes"]) == {
        "prooftrainKey",
        "prooftrainTime",
        "prooftrainSignature",
    }
    version = paths["/v1/policy/{version}"]["get"]["parameters"][0]["schema"]
    assert version["minimum"] == 0 and version["maximum"] == 2**63 - 1
    assert all("422" not in op["responses"] for item in paths.values() for op in item.values())


def test_out_of_range_input_is_a_400_not_a_500(node) -> None:
    """Found by the campaign: integers beyond SQLite's range crashed the handler; a non-string name was accepted."""
    import httpx

    from node.validator.auth import sign_request
    from node.validator.server import BackgroundServer

    v, _seeds, keys = node
    now = time.time_ns() // 1_000_000
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        assert httpx.get(f"{url}/v1/policy/{2**64}").status_code == 400
        target = f"/v1/samples?cursor={2**64}&limit=1"
        r = httpx.get(url + target, headers=sign_request(TRAINER, "GET", target, b"", now))
        assert r.status_code == 400 and r.json()["reason"] == "malformed"
        for body in (b'{"name": true}', b'{"name": "' + b"x" * 257 + b'"}', b"[]"):
            r = httpx.post(
                f"{url}/v1/register",
                content=body,
                headers=sign_request(keys["contributor"], "POST", "/v1/register", body, now),
            )
            assert r.status_code == 400 and r.json()["reason"] == "malformed", body
