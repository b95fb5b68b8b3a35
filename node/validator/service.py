"""The validator's HTTP service: FastAPI on uvicorn, msgpack bodies for rollouts.

Endpoints (OpenAPI at /openapi.json):

    GET  /healthz                    liveness, ledger size, policy version
    GET  /metrics                    Prometheus metrics
    GET  /v1/info                    validator key, origin, current version, latest checkpoint
    POST /v1/register        signed  register the calling key (JSON {"name": ...})
    POST /v1/assign          signed  one WorkAssignment for the calling key (msgpack SignedAssignment)
    POST /v1/submit                  msgpack GroupSubmission -> msgpack SignedGroupVerdict
    GET  /v1/policy/{version}        msgpack SignedManifest
    POST /v1/policy          trainer msgpack SignedManifest -> {"version": v}
    POST /v1/trainer/eval    trainer msgpack SignedEvalStatement -> {"index": ledger index}
    GET  /v1/trainer/evals           {"versions": [...]}: versions the trainer key has evals recorded for
    GET  /v1/blobs/{digest}          a content-addressed blob (weight updates, evidence)
    POST /v1/blobs           trainer store a blob -> {"digest": hex}
    GET  /v1/samples         trainer accepted samples from ?cursor=N&limit=M (msgpack SampleBatch)

Submissions are admitted in batches (``node.validator.intake``): every
submission waiting when an admission thread is free goes into its next batch,
with one spot-check forward pass and one ledger transaction for all of them.
With ``node.admission_processes`` set, each submission's envelopes are first
verified and scored in a worker process (``node.validator.precheck``), each on a
CPU of its own while there are CPUs to spare (``node.cpu_affinity``). Every
other validator call runs on one worker thread. When ``audit.queue`` calls
are already waiting, submissions get 429 with Retry-After. ``POST /v1/submit``
is served directly on the ASGI messages, ahead of FastAPI's middleware and
routing, with the same handling and error handlers as its declared route
(``_ValidatorApp``).
Errors are JSON ``{"reason": ..., "message": ...}`` with a status chosen from
the reason; malformed input never produces a 500.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from node.validator import affinity, trainer_side
from node.validator.activity import ActivityLog
from node.validator.auth import verify_request
from node.validator.core import SubmitResult, Validator
from node.validator.intake import AdmissionQueue
from node.validator.precheck import Prechecked, PrecheckPool
from verify.errors import ConfigError, ProofTrainError, Reason
from verify.keys import PublicKey
from verify.types import (
    SignedEvalStatement,
    SignedManifest,
    canonical_bytes,
    decode,
)

MSGPACK = "application/msgpack"
MSGPACK_BYTES = MSGPACK.encode()
_STATUS = {
    Reason.UNAUTHORIZED: 401, Reason.UNKNOWN_KEY: 403, Reason.BANNED_KEY: 403,
    Reason.UNKNOWN_ASSIGNMENT: 404, Reason.NOT_FOUND: 404, Reason.REPLAY: 409, Reason.TOO_LARGE: 413,
    Reason.RATE_LIMITED: 429, Reason.BACKPRESSURE: 429, Reason.ASSIGNMENT_LIMIT: 429,
}
T = TypeVar("T")
INT64_MAX = 2**63 - 1  # SQLite INTEGER range: a larger version or cursor cannot be looked up
# OpenAPI: every signed endpoint needs all three X-Prooftrain-* headers (see node/validator/auth.py).
SIGNED: list[dict[str, list[str]]] = [{"prooftrainKey": [], "prooftrainTime": [], "prooftrainSignature": []}]
_SECURITY_SCHEMES = {
    name: {"type": "apiKey", "in": "header", "name": header, "description": text}
    for name, header, text in [
        ("prooftrainKey", "X-Prooftrain-Key", "64 hex digits: the caller's Ed25519 public key"),
        ("prooftrainTime", "X-Prooftrain-Time", "milliseconds since the epoch, within 120 s of the node's clock"),
        ("prooftrainSignature", "X-Prooftrain-Signature",
         "128 hex digits: Ed25519 over method, path with query, time and the body's blake3 digest"),
    ]
}
_ERROR_TEXT = {400: "malformed input", 401: "missing, stale or invalid request signature",
               403: "unknown or banned key", 404: "not found", 409: "replayed submission",
               413: "body over limits.max_body_bytes", 429: "rate limited or audit queue full (Retry-After)"}


class ErrorBody(BaseModel):
    """Every error response: a ``Reason`` code and a human-readable message."""

    reason: str
    message: str


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": _ERROR_TEXT[code]} for code in codes}


def _binary(media_type: str, max_bytes: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "format": "binary"}
    if max_bytes is not None:
        schema["maxLength"] = max_bytes
    return {media_type: {"schema": schema}}


def _ok_binary(media_type: str, what: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": what, "content": _binary(media_type)}}


def _finish_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Add the signature schemes; drop FastAPI's 422 (validation errors answer 400 ``ErrorBody``)."""
    components = spec.setdefault("components", {})
    components["securitySchemes"] = _SECURITY_SCHEMES
    for schema in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(schema, None)
    for item in spec.get("paths", {}).values():
        for op in item.values():
            op.get("responses", {}).pop("422", None)
    return spec


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
        self.requests = Counter("prooftrain_http_requests_total", "HTTP requests answered, by route "
                                "and status", ["endpoint", "status"], registry=self.registry)
        self.verdicts = Counter("prooftrain_verify_verdicts_total", "rollout verdicts",
                                ["accepted", "reason"], registry=self.registry)
        self.latency = Histogram("prooftrain_verify_admission_seconds", "submit latency",
                                 registry=self.registry)
        self.queue = Gauge("prooftrain_verify_queue_depth", "validator calls waiting",
                           registry=self.registry)
        self.ledger_size = Gauge("prooftrain_ledger_size", "ledger entries", registry=self.registry)
        self.policy_version = Gauge("prooftrain_policy_version", "current policy version",
                                    registry=self.registry)
        self.audit_rate = Gauge("prooftrain_verify_audit_rate", "fraction of the rollouts judged since "
                                "the node started that were audited", registry=self.registry)
        self.banned = Gauge("prooftrain_reputation_banned", "contributors banned", registry=self.registry)
        self.prechecked = Counter("prooftrain_verify_prechecked_total",
                                  "submissions verified and scored by a precheck worker process",
                                  registry=self.registry)
        self.precheck_failures = Counter("prooftrain_verify_precheck_failures_total",
                                         "submissions a precheck worker failed to answer (checked in process)",
                                         registry=self.registry)
        self.batch_groups = Histogram("prooftrain_verify_admission_batch_groups",
                                      "submissions admitted together in one batch",
                                      buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.admitting = Counter("prooftrain_verify_admission_busy_seconds",
                                 "wall-clock seconds the admission threads spent admitting batches "
                                 "(per second: how busy they are; near their number, admission is "
                                 "the node's bottleneck)", registry=self.registry)
        self.admitting_cpu = Counter("prooftrain_verify_admission_cpu_seconds",
                                     "CPU seconds the admission threads spent admitting batches "
                                     "(the rest of their busy time they waited: for fsyncs, the "
                                     "interpreter lock or a core)", registry=self.registry)

    def admitted_batch(self, groups: int, wall_s: float, cpu_s: float) -> None:
        """One batch of ``groups`` submissions admitted in ``wall_s`` seconds, ``cpu_s`` on a CPU."""
        self.batch_groups.observe(groups)
        self.admitting.inc(wall_s)
        self.admitting_cpu.inc(cpu_s)


def _unplace(validator: Validator, placement: affinity.Placement, threads: Sequence[int] = ()) -> None:
    """The calling thread, and the threads ``threads`` names (native ids), back on every
    CPU they had before ``placement`` pinned them."""
    validator.placement = None
    affinity.pin(placement.everything)
    for thread in threads:
        affinity.pin(placement.everything, thread)


def create_app(validator: Validator, trainer: PublicKey | None = None,
               clock_ms: Callable[[], int] | None = None, admission_threads: int | None = None,
               summary_s: float = 30.0) -> FastAPI:
    """The FastAPI app around one validator; ``admission_threads`` (default: the validator's
    ``node.admission_threads``) admit submissions. While it serves, events and an admission
    summary every ``summary_s`` seconds are logged (``node.validator.activity``)."""
    cfg = validator.cfg
    clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
    # Its thread starts on first use, inheriting the CPUs of the thread that used it: while
    # serving, the event loop's (pinned) one. Its id is kept to give it its CPUs back after.
    executor_threads: list[int] = []
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validator",
                                  initializer=lambda: executor_threads.append(threading.get_native_id()))
    threads = validator.cfg.node.admission_threads if admission_threads is None else admission_threads
    buckets = TokenBuckets(cfg.limits.requests_per_s, cfg.limits.burst)
    metrics = Metrics()
    state = {"waiting": 0}
    running: dict[str, Any] = {}  # the admission queue and precheck pool, while serving

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Undone in reverse: the admission queue closes first (admitting what it holds),
        # then the precheck workers, then the event loop's thread gets its CPUs back.
        with contextlib.ExitStack() as undo:
            # The event loop's thread runs this: pinned first, the admission threads, the
            # executor's and the workers' start inherit its CPUs (each worker is then moved to its own).
            before = affinity.allowed()
            placement = (affinity.plan(before, cfg.node.admission_processes)
                         if cfg.node.cpu_affinity and before is not None else None)
            if placement is not None and affinity.pin(placement.node):
                validator.placement = placement
                undo.callback(_unplace, validator, placement, executor_threads)
            else:
                placement = None
            activity = ActivityLog(validator.ledger, metrics, lambda: state["waiting"], summary_s)
            activity.start()
            undo.callback(activity.stop)  # after the intake closes: its last entries are logged too
            undo.callback(lambda: running.pop("prechecks").close() if "prechecks" in running else None)
            running["intake"] = AdmissionQueue(
                lambda items: validator.admit_in_turn([raw for raw, _ in items], [pre for _, pre in items]),
                threads=max(1, threads), max_batch=cfg.audit.queue, observe=metrics.admitted_batch)
            undo.callback(lambda: running.pop("intake").close())
            if cfg.node.admission_processes:
                try:
                    running["prechecks"] = await asyncio.get_running_loop().run_in_executor(
                        executor, lambda: PrecheckPool(cfg.node.admission_processes, validator.limits,
                                                       validator.codec,
                                                       cpus=placement.workers if placement else None))
                except Exception as exc:
                    raise ConfigError(f"node.admission_processes: the precheck workers did not start: {exc}") from exc
            yield

    app = _ValidatorApp(title="prooftrain validator", version="1", lifespan=lifespan,
                        description="Assigns work, admits signed rollout groups, serves accepted samples.")
    max_body = cfg.limits.max_body_bytes
    default_openapi = app.openapi
    app.openapi = lambda: app.openapi_schema or _finish_spec(default_openapi())  # type: ignore[method-assign]

    @contextlib.contextmanager
    def waiting() -> Iterator[None]:
        """Count a validator call as waiting (the queue-depth gauge) while it runs."""
        state["waiting"] += 1
        metrics.queue.set(state["waiting"])
        try:
            yield
        finally:
            state["waiting"] -= 1
            metrics.queue.set(state["waiting"])

    async def call(fn: Callable[[], T]) -> T:
        with waiting():
            return await asyncio.get_running_loop().run_in_executor(executor, fn)

    async def prechecked(body: bytes) -> Prechecked | None:
        """The submission verified and scored by a worker process, when the node has them."""
        pool: PrecheckPool | None = running.get("prechecks")
        job = validator.precheck_job(body) if pool is not None else None
        if pool is None or job is None:
            return None
        try:
            pre = await pool.check(body, *job)
        except Exception:  # noqa: BLE001 - a lost worker: the admission thread does the work itself
            metrics.precheck_failures.inc()
            return None
        metrics.prechecked.inc()
        return pre

    async def admitted(body: bytes) -> SubmitResult:
        if state["waiting"] >= cfg.audit.queue:
            raise ApiError(Reason.BACKPRESSURE, "audit queue is full")
        with waiting():
            pre = await prechecked(body)
            return await asyncio.wrap_future(running["intake"].submit((body, pre)))  # type: ignore[no-any-return]

    async def body_of(request: Request) -> bytes:
        return await _asgi_body(request.scope, request.receive, cfg.limits.max_body_bytes)

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

    @app.exception_handler(RequestValidationError)
    async def _invalid_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors()[:5])
        return _error(Reason.MALFORMED, f"invalid parameter: {where}", request, metrics)

    @app.exception_handler(ProofTrainError)
    async def _domain_error(request: Request, exc: ProofTrainError) -> JSONResponse:
        reason = getattr(exc, "reason", Reason.MALFORMED)
        return _error(reason, str(exc), request, metrics)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        size = await call(validator.ledger.size)
        metrics.ledger_size.set(size)
        return {"ok": True, "ledger_size": size, "policy_version": validator.versions.current}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text exposition",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        metrics.ledger_size.set(await call(validator.ledger.size))  # what /healthz says, now
        metrics.policy_version.set(validator.versions.current)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    a = cfg.assignment
    network = {  # what the node fixes for everyone: trainers and contributors read it, never repeat it
        "base_model_digest": validator.versions.base_digest.hex(), "task": cfg.task.name,
        "max_staleness": cfg.policy.max_staleness, "group_size": a.group_size,
        "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "max_tokens": a.max_tokens,
        "chunk_size": a.chunk_size, "max_outstanding": a.max_outstanding}

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        cp = await call(validator.ledger.latest_checkpoint)
        return {"validator_key": validator.key.public.hex(), "origin": validator.ledger.origin,
                "policy_version": validator.versions.current,
                "trainer_key": trainer.hex() if trainer else None,
                "checkpoint": cp.to_text() if cp else None, "network": network}

    @app.post("/v1/register", responses=_errors(400, 401, 403, 413, 429), openapi_extra={
        "security": SIGNED, "requestBody": {"required": False, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 256}}}}}}})
    async def register(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        key = await caller(request, body)
        try:
            name = msgspec.json.decode(body or b"{}").get("name", "")
        except (msgspec.DecodeError, AttributeError):
            name = None
        if not isinstance(name, str) or len(name) > 256:  # as declared: a string of at most 256 characters
            raise ApiError(Reason.MALFORMED, 'body must be JSON {"name": "<at most 256 characters>"}')
        added = await call(lambda: validator.register(key.raw, name))
        return {"registered": added, "fingerprint": key.fingerprint}

    @app.post("/v1/assign", response_class=Response, openapi_extra={"security": SIGNED},
              responses={**_ok_binary(MSGPACK, "msgpack SignedAssignment"), **_errors(400, 401, 403, 413, 429)})
    async def assign(request: Request) -> Response:
        body = await body_of(request)
        key = await caller(request, body)
        sealed = await call(lambda: validator.assign(key.raw))
        return Response(canonical_bytes(sealed), media_type=MSGPACK)

    @app.post("/v1/submit", response_class=Response,
              openapi_extra={"requestBody": {"required": True, "content": _binary(MSGPACK, max_body)}},
              responses={**_ok_binary(MSGPACK, "msgpack SignedGroupVerdict"),
                         **_errors(400, 403, 404, 409, 413, 429)})
    async def submit(request: Request) -> Response:
        body = await body_of(request)
        return Response(await answer_to(body, request.client.host if request.client else "?"),
                        media_type=MSGPACK)

    async def answer_to(body: bytes, host: str) -> bytes:
        """The msgpack ``SignedGroupVerdict`` answering a submitted group (both routes)."""
        limit_rate(f"ip:{host}")
        start = time.perf_counter()
        result = await admitted(body)
        metrics.latency.observe(time.perf_counter() - start)
        if result.fresh:
            for reason, count in collections.Counter(result.reasons).items():
                metrics.verdicts.labels(str(not reason).lower(), reason or "accepted").inc(count)
        return canonical_bytes(result.answer)

    @app.get("/v1/policy/{version}", response_class=Response,
             responses={**_ok_binary(MSGPACK, "msgpack SignedManifest"), **_errors(400, 404)})
    async def get_policy(version: Annotated[int, Path(ge=0, le=INT64_MAX)]) -> Response:
        data = await call(lambda: validator.state.manifest(version))
        if data is None:
            raise ApiError(Reason.NOT_FOUND, f"no manifest for policy version {version}")
        return Response(data, media_type=MSGPACK)

    @app.post("/v1/policy", responses=_errors(400, 401, 403, 404, 409, 413, 429), openapi_extra={
        "security": SIGNED, "requestBody": {"required": True, "content": _binary(MSGPACK, max_body)}})
    async def post_policy(request: Request) -> dict[str, int]:
        body = await body_of(request)
        await trainer_only(request, body)
        sealed = decode(SignedManifest, body, max_bytes=len(body))
        return {"version": await call(lambda: validator.publish_policy(sealed))}

    @app.post("/v1/trainer/eval", responses=_errors(400, 401, 403, 404, 409, 413, 429), openapi_extra={
        "security": SIGNED, "requestBody": {"required": True, "content": _binary(MSGPACK, max_body)}})
    async def post_eval(request: Request) -> dict[str, int]:
        body = await body_of(request)
        await trainer_only(request, body)
        sealed = decode(SignedEvalStatement, body, max_bytes=len(body))
        return {"index": await call(lambda: validator.record_eval(sealed))}

    @app.get("/v1/trainer/evals")
    async def get_evals() -> dict[str, list[int]]:
        """Versions with an eval recorded by the trainer key (the ledger is public: no signature)."""
        return {"versions": await call(lambda: trainer_side.recorded_evals(validator.ledger, trainer))}

    @app.get("/v1/blobs/{digest}", response_class=Response,
             responses={**_ok_binary("application/octet-stream", "the blob's bytes"), **_errors(400, 404)})
    async def get_blob(digest: Annotated[str, Path(min_length=64, max_length=64,
                                                   pattern="^[0-9a-fA-F]{64}$")]) -> Response:
        blobs = validator.ledger.blobs
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            raise ApiError(Reason.MALFORMED, "digest must be 64 hex digits") from None
        if blobs is None or len(raw) != 32 or not blobs.has(raw):
            raise ApiError(Reason.NOT_FOUND, "no such blob")
        return Response(blobs.get(raw), media_type="application/octet-stream")

    @app.post("/v1/blobs", responses=_errors(400, 401, 413, 429), openapi_extra={
        "security": SIGNED,
        "requestBody": {"required": True, "content": _binary("application/octet-stream", max_body)}})
    async def post_blob(request: Request) -> dict[str, str]:
        body = await body_of(request)
        await trainer_only(request, body)
        if validator.ledger.blobs is None:
            raise ApiError(Reason.MALFORMED, "this validator has no blob store")
        return {"digest": validator.ledger.blobs.put(body).hex()}

    @app.get("/v1/samples", response_class=Response, openapi_extra={"security": SIGNED},
             responses={**_ok_binary(MSGPACK, "msgpack SampleBatch"), **_errors(400, 401, 429)})
    async def samples(request: Request, cursor: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
                      limit: Annotated[int, Query(ge=1, le=4_096)] = 256) -> Response:
        await trainer_only(request, b"")
        if cursor < 0 or not 1 <= limit <= 4_096:
            raise ApiError(Reason.MALFORMED, "cursor must be >= 0 and limit in [1, 4096]")
        batch = await call(lambda: validator.samples(cursor, limit))
        return Response(canonical_bytes(batch), media_type=MSGPACK)

    async def submit_direct(scope: Scope, receive: Receive, send: Send) -> None:
        """``submit`` with its error handlers, on the ASGI messages themselves: no request,
        response or routing objects in between (the answer's headers are a ``Response``'s)."""
        try:
            body = await _asgi_body(scope, receive, cfg.limits.max_body_bytes)
            client = scope.get("client")
            data = await answer_to(body, client[0] if client else "?")
        except ClientDisconnect:
            return
        except ApiError as exc:
            await (await _api_error(Request(scope, receive), exc))(scope, receive, send)
            return
        except ProofTrainError as exc:
            await (await _domain_error(Request(scope, receive), exc))(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(data)).encode()), (b"content-type", MSGPACK_BYTES)]})
        await send({"type": "http.response.body", "body": data})

    app.direct[("POST", "/v1/submit")] = submit_direct
    app.count = lambda path, status: metrics.requests.labels(_route(path), str(status)).inc()
    app.state.validator = validator
    app.state.metrics = metrics
    return app


class _ValidatorApp(FastAPI):
    """FastAPI, with a few hot routes served directly (``direct``: (method, path) -> ASGI app).

    A submission is the node's most frequent request, and FastAPI's middleware,
    routing and endpoint wrappers cost about as much CPU time per request as the
    endpoint's own code. A direct route is still declared as a FastAPI route, so
    it has the same OpenAPI entry, and it answers as that route does: the same
    handler, the same error handlers.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {}
        self.count: Callable[[str, int], None] = lambda path, status: None
        """Called once per answered request with its path and status (the request counter)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        path = scope["path"]

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.count(path, message["status"])
            await send(message)

        if route := self.direct.get((scope["method"], path)):
            await route(scope, receive, counted)
            return
        await super().__call__(scope, receive, counted)


_ROUTES = ("/healthz", "/metrics", "/openapi.json", "/docs", "/v1/info", "/v1/register", "/v1/assign",
           "/v1/submit", "/v1/policy", "/v1/trainer/evals", "/v1/trainer/eval", "/v1/blobs",
           "/v1/samples")


def _route(path: str) -> str:
    """The route a path belongs to (``/v1/policy/3`` -> ``/v1/policy``); "other" for any
    path the node does not serve, so unknown paths cannot grow the label set."""
    for route in _ROUTES:
        if path == route or path.startswith(route + "/"):
            return route
    return "other"


async def _asgi_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """A request's body from its ASGI messages: TOO_LARGE past ``limit`` bytes (declared or
    sent), ``ClientDisconnect`` if the client goes away first."""
    for name, value in scope["headers"]:
        if name == b"content-length" and (not value.isdigit() or int(value) > limit):
            raise ApiError(Reason.TOO_LARGE, f"request body exceeds {limit} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(Reason.TOO_LARGE, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _error(reason: Reason, message: str, request: Request, metrics: Metrics) -> JSONResponse:
    status = _STATUS.get(reason, 400)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse({"reason": reason.value, "message": message[:1_000]}, status_code=status,
                        headers=headers)

