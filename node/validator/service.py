"""The validator's HTTP service: FastAPI on uvicorn, msgpack bodies for rollouts.

Endpoints (OpenAPI at /openapi.json):

    GET  /healthz                    liveness, ledger size, policy version
    GET  /metrics                    Prometheus metrics
    GET  /v1/info                    validator key, origin, current version, latest checkpoint
    POST /v1/register        signed  register the calling key (JSON {"name": ...})
    POST /v1/assign          signed  one WorkAssignment for the calling key (msgpack SignedAssignment)
    POST /v1/submit                  msgpack GroupSubmission -> msgpack list[SignedVerdict]
    GET  /v1/policy/{version}        msgpack SignedManifest
    POST /v1/policy          trainer msgpack SignedManifest -> {"version": v}
    GET  /v1/blobs/{digest}          a content-addressed blob (weight updates, evidence)
    POST /v1/blobs           trainer store a blob -> {"digest": hex}
    GET  /v1/samples         trainer accepted samples from ?cursor=N&limit=M (msgpack SampleBatch)

Every validator call runs on one worker thread (the ledger and the model are
used from one thread, and the queue in front of it is the audit queue): when
more than ``audit.queue`` requests wait, submissions get 429 with Retry-After.
Errors are JSON ``{"reason": ..., "message": ...}`` with a status chosen from
the reason; malformed input never produces a 500.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from node.validator.auth import verify_request
from node.validator.core import Validator
from verify.errors import ProofTrainError, Reason
from verify.keys import PublicKey
from verify.types import SignedManifest, SignedVerdict, Verdict, canonical_bytes, decode

MSGPACK = "application/msgpack"
_STATUS = {
    Reason.UNAUTHORIZED: 401, Reason.UNKNOWN_KEY: 403, Reason.BANNED_KEY: 403,
    Reason.UNKNOWN_ASSIGNMENT: 404, Reason.NOT_FOUND: 404, Reason.REPLAY: 409, Reason.TOO_LARGE: 413,
    Reason.RATE_LIMITED: 429, Reason.BACKPRESSURE: 429,
}
T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TokenBuckets:
    """Per-caller token buckets: ``rate`` tokens per second, at most ``burst`` saved."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, who: str) -> float:
        """0 if allowed, else the seconds to wait."""
        now = self.clock()
        tokens, last = self._buckets.get(who, (float(self.burst), now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[who] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[who] = (tokens - 1.0, now)
        if len(self._buckets) > 100_000:  # bound memory under key churn
            self._buckets.clear()
        return 0.0


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("prooftrain_http_requests_total", "HTTP requests",
                                ["endpoint", "status"], registry=self.registry)
        self.verdicts = Counter("prooftrain_verify_verdicts_total", "rollout verdicts",
                                ["accepted", "reason"], registry=self.registry)
        self.latency = Histogram("prooftrain_verify_admission_seconds", "submit latency",
                                 registry=self.registry)
        self.queue = Gauge("prooftrain_verify_queue_depth", "validator calls waiting",
                           registry=self.registry)
        self.ledger_size = Gauge("prooftrain_ledger_size", "ledger entries", registry=self.registry)


def create_app(validator: Validator, trainer: PublicKey | None = None,
               clock_ms: Callable[[], int] | None = None) -> FastAPI:
    """The FastAPI app around one validator."""
    cfg = validator.cfg
    clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validator")
    buckets = TokenBuckets(cfg.limits.requests_per_s, cfg.limits.burst)
    metrics = Metrics()
    state = {"waiting": 0}
    app = FastAPI(title="prooftrain validator", version="1",
                  description="Assigns work, admits signed rollout groups, serves accepted samples.")

    async def call(fn: Callable[[], T], *, queued: bool = False) -> T:
        if queued and state["waiting"] >= cfg.audit.queue:
            raise ApiError(Reason.BACKPRESSURE, "audit queue is full")
        state["waiting"] += 1
        metrics.queue.set(state["waiting"])
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn)
        finally:
            state["waiting"] -= 1
            metrics.queue.set(state["waiting"])

    async def body_of(request: Request) -> bytes:
        limit = cfg.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ApiError(Reason.TOO_LARGE, f"request body exceeds {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(Reason.TOO_LARGE, f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def limit_rate(who: str) -> None:
        wait = buckets.take(who)
        if wait > 0:
            raise ApiError(Reason.RATE_LIMITED, f"rate limit: retry in {wait:.2f} s")

    async def caller(request: Request, body: bytes) -> PublicKey:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        key = verify_request(request.headers, request.method, target, body, clock_ms())
        limit_rate(key.hex())
        return key

    async def trainer_only(request: Request, body: bytes) -> None:
        key = await caller(request, body)
        if trainer is None or key != trainer:
            raise ApiError(Reason.UNAUTHORIZED, "only the trainer key may call this endpoint")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.reason, str(exc), request, metrics)

    @app.exception_handler(ProofTrainError)
    async def _domain_error(request: Request, exc: ProofTrainError) -> JSONResponse:
        reason = getattr(exc, "reason", Reason.MALFORMED)
        return _error(reason, str(exc), request, metrics)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        size = await call(validator.ledger.size)
        metrics.ledger_size.set(size)
        return {"ok": True, "ledger_size": size, "policy_version": validator.versions.current}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        cp = await call(validator.ledger.latest_checkpoint)
        return {"validator_key": validator.key.public.hex(), "origin": validator.ledger.origin,
                "policy_version": validator.versions.current,
                "trainer_key": trainer.hex() if trainer else None,
                "checkpoint": cp.to_text() if cp else None}

    @app.post("/v1/register")
    async def register(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        key = await caller(request, body)
        try:
            name = str(msgspec.json.decode(body or b"{}").get("name", ""))[:256]
        except (msgspec.DecodeError, AttributeError):
            raise ApiError(Reason.MALFORMED, 'body must be JSON {"name": "..."}') from None
        added = await call(lambda: validator.register(key.raw, name))
        return {"registered": added, "fingerprint": key.fingerprint}

    @app.post("/v1/assign")
    async def assign(request: Request) -> Response:
        body = await body_of(request)
        key = await caller(request, body)
        sealed = await call(lambda: validator.assign(key.raw))
        return Response(canonical_bytes(sealed), media_type=MSGPACK)

    @app.post("/v1/submit")
    async def submit(request: Request) -> Response:
        body = await body_of(request)
        limit_rate(f"ip:{request.client.host if request.client else '?'}")
        start = time.perf_counter()
        result = await call(lambda: validator.admit(body), queued=True)
        metrics.latency.observe(time.perf_counter() - start)
        if result.fresh:
            for sv in result.verdicts:
                _count_verdict(sv, metrics)
        return Response(msgspec.msgpack.encode(result.verdicts), media_type=MSGPACK)

    @app.get("/v1/policy/{version}")
    async def get_policy(version: int) -> Response:
        data = await call(lambda: validator.state.manifest(version))
        if data is None:
            raise ApiError(Reason.NOT_FOUND, f"no manifest for policy version {version}")
        return Response(data, media_type=MSGPACK)

    @app.post("/v1/policy")
    async def post_policy(request: Request) -> dict[str, int]:
        body = await body_of(request)
        await trainer_only(request, body)
        sealed = decode(SignedManifest, body, max_bytes=len(body))
        return {"version": await call(lambda: validator.publish_policy(sealed))}

    @app.get("/v1/blobs/{digest}")
    async def get_blob(digest: str) -> Response:
        blobs = validator.ledger.blobs
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            raise ApiError(Reason.MALFORMED, "digest must be 64 hex digits") from None
        if blobs is None or len(raw) != 32 or not blobs.has(raw):
            raise ApiError(Reason.NOT_FOUND, "no such blob")
        return Response(blobs.get(raw), media_type="application/octet-stream")

    @app.post("/v1/blobs")
    async def post_blob(request: Request) -> dict[str, str]:
        body = await body_of(request)
        await trainer_only(request, body)
        if validator.ledger.blobs is None:
            raise ApiError(Reason.MALFORMED, "this validator has no blob store")
        return {"digest": validator.ledger.blobs.put(body).hex()}

    @app.get("/v1/samples")
    async def samples(request: Request, cursor: int = 0, limit: int = 256) -> Response:
        await trainer_only(request, b"")
        if cursor < 0 or not 1 <= limit <= 4_096:
            raise ApiError(Reason.MALFORMED, "cursor must be >= 0 and limit in [1, 4096]")
        batch = await call(lambda: validator.samples(cursor, limit))
        return Response(canonical_bytes(batch), media_type=MSGPACK)

    app.state.validator = validator
    app.state.metrics = metrics
    return app


def _count_verdict(sealed: SignedVerdict, metrics: Metrics) -> None:
    v = decode(Verdict, sealed.verdict, max_bytes=len(sealed.verdict))
    metrics.verdicts.labels(str(v.accepted).lower(), v.reason or "accepted").inc()


def _error(reason: Reason, message: str, request: Request, metrics: Metrics) -> JSONResponse:
    status = _STATUS.get(reason, 400)
    metrics.requests.labels(request.url.path.split("/")[2] if request.url.path.count("/") > 1 else "root",
                            str(status)).inc()
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse({"reason": reason.value, "message": message[:1_000]}, status_code=status,
                        headers=headers)

