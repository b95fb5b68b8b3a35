"""The validator over real HTTP on 127.0.0.1: contributors, the trainer stream, and fuzzing."""

from __future__ import annotations

import contextlib
import sqlite3

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.audit import verify_ledger
from node.client import ServiceError, ValidatorClient
from node.validator.server import BackgroundServer, server_config
from node.validator.service import create_app
from rollout.worker import answer
from verify.errors import Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import canonical_bytes

TRAINER = SigningKey.from_seed(b"\x77" * 32)
ALICE = SigningKey.from_seed(b"\x61" * 32)


@pytest.fixture
def live(make_validator):
    with _serving(make_validator) as served:
        yield served


@contextlib.contextmanager
def _serving(make_validator, processes: int = 0):  # type: ignore[no-untyped-def]
    v = make_validator(
        {
            "limits.requests_per_s": 1000.0,
            "limits.burst": 1000,
            "node.admission_processes": processes,
        }
    )
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        yield v, url


def test_the_node_parses_http_with_httptools_on_uvloop() -> None:
    """Both are dependencies: a node on h11 and asyncio's loop spends about 2.5 times the CPU
    per submission on HTTP."""
    import uvloop
    from fastapi import FastAPI
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = server_config(FastAPI(), "127.0.0.1", 0)
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    assert config.get_loop_factory() is uvloop.new_event_loop


def test_contributor_round_trip_and_trainer_stream(live, backend, codec) -> None:
    v, url = live
    alice = ValidatorClient(url, ALICE)
    assert alice.register("alice") is True and alice.register("alice") is False
    for _ in range(2):
        sealed = alice.assign()
        group = answer(ALICE, sealed, v.key.public, backend, codec)
        signed = alice.submit(group)
        assert all(x.accepted for x in open_group_verdict(signed, v.key.public))
        assert alice.submit(group) == signed  # idempotent over HTTP too
    trainer = ValidatorClient(url, TRAINER)
    batch = trainer.samples(0, limit=5)
    assert len(batch.samples) == 5
    rest = trainer.samples(batch.next_cursor)
    assert len(rest.samples) == 3
    with pytest.raises(ServiceError) as exc:
        alice.samples(0)
    assert exc.value.status == 401 and exc.value.reason is Reason.UNAUTHORIZED
    health = httpx.get(f"{url}/healthz").json()
    assert health["ok"] and health["ledger_size"] == v.ledger.size()
    metrics = httpx.get(f"{url}/metrics").text
    assert 'prooftrain_verify_verdicts_total{accepted="true",reason="accepted"} 8.0' in metrics
    values = dict(
        line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#")
    )
    assert float(values["prooftrain_verify_admission_batch_groups_sum"]) == 4  # resubmissions too
    assert 1 <= float(values["prooftrain_verify_admission_batch_groups_count"]) <= 4
    busy = float(values["prooftrain_verify_admission_busy_seconds_total"])
    assert 0 < float(values["prooftrain_verify_admission_cpu_seconds_total"]) <= busy
    spec = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/submit", "/v1/assign", "/v1/samples", "/healthz"} <= set(spec["paths"])


def test_the_direct_submit_route_answers_as_the_framework_route(
    make_validator, backend, codec
) -> None:
    v = make_validator(
        {"limits.requests_per_s": 1000.0, "limits.burst": 1000, "limits.max_body_bytes": 65_536}
    )
    app = create_app(v, TRAINER.public)
    direct = dict(app.direct)
    assert set(direct) == {("POST", "/v1/submit")}

    def both(content: bytes, method: str = "POST") -> list[tuple]:
        answers = []
        for routes in (direct, {}):  # served directly, then through FastAPI's routing
            app.direct = routes
            r = httpx.request(method, f"{url}/v1/submit", content=content)
            answers.append(
                (
                    r.status_code,
                    r.headers.get("content-type"),
                    r.headers.get("retry-after"),
                    r.content,
                )
            )
        return answers

    with BackgroundServer(app) as url:
        alice = ValidatorClient(url, ALICE)
        alice.register("alice")
        group = canonical_bytes(answer(ALICE, alice.assign(), v.key.public, backend, codec))
        for content in (
            b"",
            b"\x93garbage",
            b"x" * 65_537,
            group,
        ):  # the group: admitted, then its stored answer
            first, second = both(content)
            assert first == second, content[:20]
        assert first[0] == 200 and len(v.samples(0).samples) == 4
        assert [a[0] for a in both(b"", "GET")] == [405, 405]  # only POST is served directly


def test_a_client_that_leaves_mid_body_leaves_the_node_serving(live) -> None:
    """A submission cut off mid-body is dropped without an answer; the next one is served."""
    import socket
    from urllib.parse import urlsplit

    v, url = live
    where = urlsplit(url)
    for _ in range(3):
        with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
                + b"\x93" * 100
            )
    r = httpx.post(f"{url}/v1/submit", content=b"\x93garbage")
    assert r.status_code == 400 and r.json()["reason"] in {"malformed", "truncated"}
    assert verify_ledger(v.ledger.store, log_key=v.ledger.verifier).ok


def test_rejections_carry_reasons_and_statuses(live) -> None:
    v, url = live
    r = httpx.post(f"{url}/v1/submit", content=b"\x93garbage")
    assert r.status_code == 400 and r.json()["reason"] in {"malformed", "truncated"}
    r = httpx.post(f"{url}/v1/assign")
    assert r.status_code == 401 and r.json()["reason"] == "unauthorized"
    stranger = ValidatorClient(url, SigningKey.from_seed(b"\x13" * 32))
    with pytest.raises(ServiceError) as exc:
        stranger.assign()
    assert exc.value.status == 403 and exc.value.reason is Reason.UNKNOWN_KEY
    big = b"\x00" * (v.cfg.limits.max_body_bytes + 1)
    r = httpx.post(f"{url}/v1/submit", content=big)
    assert r.status_code == 413 and r.json()["reason"] == "too_large"
    r = httpx.get(f"{url}/v1/blobs/zz")
    assert r.status_code == 400


def test_rate_limit_answers_429_with_retry_after(make_validator) -> None:
    v = make_validator({"limits.requests_per_s": 0.001, "limits.burst": 2})
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        codes = [httpx.post(f"{url}/v1/submit", content=b"x").status_code for _ in range(4)]
        assert codes[:2] == [400, 400] and codes[2:] == [429, 429]
        r = httpx.post(f"{url}/v1/submit", content=b"x")
        assert "retry-after" in r.headers


def test_bogus_content_length_headers_are_refused(live) -> None:
    import socket

    v, url = live
    port = int(url.rsplit(":", 1)[1])
    for value in ("-1", "abc", "99999999999", "10"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/submit HTTP/1.1\r\nHost: x\r\nContent-Length: {value}\r\n"
                "Connection: close\r\n\r\nabc".encode()
            )
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(200).decode(errors="replace")
        status = int(reply.split()[1]) if reply.startswith("HTTP/1.1") else 400
        assert 400 <= status < 500, (value, reply)
    assert httpx.get(f"{url}/healthz").status_code == 200


ENDPOINTS = [
    ("POST", "/v1/submit"),
    ("POST", "/v1/register"),
    ("POST", "/v1/assign"),
    ("POST", "/v1/policy"),
    ("POST", "/v1/blobs"),
    ("GET", "/v1/samples"),
    ("GET", "/v1/policy/1"),
    ("GET", "/v1/blobs/00"),
]


@pytest.mark.parametrize(
    "method,path,processes", [(m, p, 0) for m, p in ENDPOINTS] + [("POST", "/v1/submit", 1)]
)
def test_fuzzed_bodies_never_cause_a_500(
    make_validator, backend, codec, method, path, processes
) -> None:
    with _serving(make_validator, processes) as (v, url):
        _fuzz(v, url, backend, codec, method, path)
        if processes:  # the hostile bodies went through the worker process, which survived them
            metrics = httpx.get(f"{url}/metrics").text
            assert "prooftrain_verify_precheck_failures_total 0.0" in metrics
            assert "prooftrain_verify_prechecked_total 0.0" not in metrics


def _fuzz(v, url: str, backend, codec, method: str, path: str) -> None:  # type: ignore[no-untyped-def]
    v.register(ALICE.public.raw, "alice")
    good = canonical_bytes(answer(ALICE, v.assign(ALICE.public.raw), v.key.public, backend, codec))
    client = httpx.Client(base_url=url)
    auth = ValidatorClient(url, ALICE)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(["random", "truncated", "mutated", "extended"]))
        if kind == "random":
            body = data.draw(st.binary(max_size=512))
        elif kind == "truncated":
            body = good[: data.draw(st.integers(0, len(good) - 1))]
        elif kind == "mutated":
            pos = data.draw(st.integers(0, len(good) - 1))
            body = good[:pos] + bytes([data.draw(st.integers(0, 255))]) + good[pos + 1 :]
        else:
            body = good + data.draw(st.binary(min_size=1, max_size=64))
        headers = {}
        if data.draw(st.booleans()):
            import time

            from node.validator.auth import sign_request

            headers = sign_request(ALICE, method, path, body, time.time_ns() // 1_000_000)
        r = client.request(method, path, content=body, headers=headers)
        assert r.status_code < 500, (r.status_code, r.text)

    fuzz()
    assert httpx.get(f"{url}/healthz").status_code == 200
    del auth
    report = verify_ledger(v.ledger.store, blobs=v.ledger.blobs)
    assert report.ok, report


def _disk_full() -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("database or disk is full")
    exc.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
    return exc


def test_a_full_disk_answers_503_storage_full_and_the_node_goes_on(
    live, backend, codec, monkeypatch, caplog
) -> None:
    """Every request that writes is refused with a reason the contributor retries (nothing
    was recorded), the operator is told what to do once, not per request, and once space
    is back the same group is admitted, judged once."""
    v, url = live
    alice = ValidatorClient(url, ALICE, retries=0)
    alice.register("alice")
    sealed = alice.assign()
    raw = canonical_bytes(answer(ALICE, sealed, v.key.public, backend, codec))
    size = v.ledger.size()
    real_append, real_put = v.ledger.append_many, v.state.put_assignments

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise _disk_full()

    monkeypatch.setattr(v.ledger, "append_many", full)
    monkeypatch.setattr(v.state, "put_assignments", full)
    with caplog.at_level("ERROR", logger="prooftrain.validator"):
        for call in (lambda: alice.submit(raw), alice.assign, lambda: alice.submit(raw)):
            with pytest.raises(ServiceError) as refused:
                call()
            assert refused.value.status == 503 and refused.value.busy
            assert refused.value.reason is Reason.STORAGE_FULL
            assert "nothing was recorded" in str(refused.value)
    told = [r.getMessage() for r in caplog.records if "disk full" in r.getMessage()]
    assert len(told) == 1 and "node.blob_dir" in told[0]
    r = httpx.post(f"{url}/v1/submit", content=raw)
    assert r.status_code == 503 and r.headers["retry-after"] == "30"
    assert r.json()["reason"] == "storage_full"
    assert v.ledger.size() == size

    monkeypatch.setattr(v.ledger, "append_many", real_append)
    monkeypatch.setattr(v.state, "put_assignments", real_put)
    got = open_group_verdict(alice.submit(raw), v.key.public)
    assert [x.accepted for x in got] == [True] * len(got)
    assert alice.assign() is not None  # the refused assignment holds no place
    spec = httpx.get(f"{url}/openapi.json").json()["paths"]
    assert "503" in spec["/v1/submit"]["post"]["responses"]
    assert "503" in spec["/v1/assign"]["post"]["responses"]
