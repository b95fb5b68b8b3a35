"""What the validator's routes share: one app's serving state, errors, OpenAPI pieces.

Errors are JSON ``{"reason": ..., "message": ...}`` (``ErrorBody``) with a
status chosen from the reason (``STATUS``); malformed input never produces a 500.
A validator call that fails because the node's disk is full answers 503
``storage_full`` with Retry-After (nothing was recorded: the same request can
be sent again), and the node logs what the operator must do, at most once a
minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from node.validator.auth import verify_request
from verify.errors import ProofTrainError, Reason
from verify.keys import PublicKey

if TYPE_CHECKING:
    from node.validator.core import Validator
    from node.validator.service import Metrics
    from verify.types import SampleBatch

MSGPACK = "application/msgpack"
MSGPACK_BYTES = MSGPACK.encode()
STATUS = {
    Reason.UNAUTHORIZED: 401,
    Reason.UNKNOWN_KEY: 403,
    Reason.BANNED_KEY: 403,
    Reason.UNKNOWN_ASSIGNMENT: 404,
    Reason.NOT_FOUND: 404,
    Reason.REPLAY: 409,
    Reason.TOO_LARGE: 413,
    Reason.RATE_LIMITED: 429,
    Reason.BACKPRESSURE: 429,
    Reason.ASSIGNMENT_LIMIT: 429,
    Reason.STORAGE_FULL: 503,
}
RETRY_AFTER_S = {429: 1, 503: 30}
"""Retry-After of a refusal that is no final answer: busy (429), disk full (503)."""
LOG = logging.getLogger("prooftrain.validator")
T = TypeVar("T")
INT64_MAX = 2**63 - 1  # SQLite INTEGER range: a larger version or cursor cannot be looked up
# OpenAPI: every signed endpoint needs all three X-Prooftrain-* headers (see node/validator/auth.py).
SIGNED: list[dict[str, list[str]]] = [
    {"prooftrainKey": [], "prooftrainTime": [], "prooftrainSignature": []}
]
SECURITY_SCHEMES = {
    name: {"type": "apiKey", "in": "header", "name": header, "description": text}
    for name, header, text in [
        ("prooftrainKey", "X-Prooftrain-Key", "64 hex digits: the caller's Ed25519 public key"),
        (
            "prooftrainTime",
            "X-Prooftrain-Time",
            "milliseconds since the epoch, within 120 s of the node's clock",
        ),
        (
            "prooftrainSignature",
            "X-Prooftrain-Signature",
            "128 hex digits: Ed25519 over method, path with query, time and the body's blake3 digest",
        ),
    ]
}
_ERROR_TEXT = {
    400: "malformed input",
    401: "missing, stale or invalid request signature",
    403: "unknown or banned key",
    404: "not found",
    409: "replayed submission",
    413: "body over limits.max_body_bytes",
    429: "rate limited or audit queue full (Retry-After)",
    503: "the node's disk is full: nothing was recorded (Retry-After)",
}

DirectRoute = Callable[[Scope, Receive, Send], Awaitable[None]]
"""A route served on the ASGI messages themselves (``service._ValidatorApp.direct``)."""


class ErrorBody(BaseModel):
    """Every error response: a ``Reason`` code and a human-readable message."""

    reason: str
    message: str


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses (each an ``ErrorBody``)."""
    return {code: {"model": ErrorBody, "description": _ERROR_TEXT[code]} for code in codes}


def binary(media_type: str, max_bytes: int | None = None) -> dict[str, Any]:
    """OpenAPI ``content`` of a binary body, at most ``max_bytes`` long when given."""
    schema: dict[str, Any] = {"type": "string", "format": "binary"}
    if max_bytes is not None:
        schema["maxLength"] = max_bytes
    return {media_type: {"schema": schema}}


def ok_binary(media_type: str, what: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entry of a 200 with a binary body."""
    return {200: {"description": what, "content": binary(media_type)}}


class ApiError(Exception):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def error_response(reason: Reason, message: str) -> JSONResponse:
    status = STATUS.get(reason, 400)
    headers = {"Retry-After": str(RETRY_AFTER_S[status])} if status in RETRY_AFTER_S else None
    return JSONResponse(
        {"reason": reason.value, "message": message[:1_000]}, status_code=status, headers=headers
    )


# The app's exception handlers (``create_app`` registers them; the direct submit route calls them).
async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.reason, str(exc))


async def invalid_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
    where = "; ".join(
        f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors()[:5]
    )
    return error_response(Reason.MALFORMED, f"invalid parameter: {where}")


async def domain_error(request: Request, exc: ProofTrainError) -> JSONResponse:
    reason = getattr(exc, "reason", Reason.MALFORMED)
    return error_response(reason, str(exc))


def storage_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a write found the disk full: ENOSPC or EDQUOT, SQLite's
    SQLITE_FULL, PostgreSQL's disk_full (SQLSTATE 53100)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    return getattr(exc, "sqlstate", None) == "53100"


class TokenBuckets:
    """Per-caller token buckets: ``rate`` tokens per second, at most ``burst`` saved."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
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


class Serving:
    """What every route of one app shares: the validator and the trainer key, the metrics,
    the one worker thread every validator call runs on, per-caller rate limits, and (while
    the app serves) the admission queue and the precheck pool."""

    def __init__(
        self,
        validator: Validator,
        trainer: PublicKey | None,
        metrics: Metrics,
        clock_ms: Callable[[], int],
    ) -> None:
        self.validator, self.cfg, self.trainer = validator, validator.cfg, trainer
        self.metrics, self.clock_ms = metrics, clock_ms
        self.buckets = TokenBuckets(self.cfg.limits.requests_per_s, self.cfg.limits.burst)
        # Its thread starts on first use, inheriting the CPUs of the thread that used it: while
        # serving, the event loop's (pinned) one. Its id is kept to give it its CPUs back after.
        self.executor_threads: list[int] = []
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="validator",
            initializer=lambda: self.executor_threads.append(threading.get_native_id()),
        )
        self.waiting_calls = 0
        """Validator calls waiting or running (the queue-depth gauge)."""
        self._full_logged_at = -60.0  # the last "disk full" log line (time.monotonic)
        self.running: dict[str, Any] = {}
        """The admission queue ("intake") and precheck pool ("prechecks"), while serving."""
        self.read_through = 0
        """The highest cursor a trainer's sample read reached (0: none yet); samples below it
        were read."""

    def samples_read(self, batch: SampleBatch, verdict_times: list[int]) -> None:
        """A trainer read ``batch`` (``verdict_times``: its samples' verdicts' ``at_ms``): how
        long each sample read for the first time waited, and where the trainer's cursor is."""
        now_ms = self.clock_ms()
        for sample, at_ms in zip(batch.samples, verdict_times, strict=True):
            if sample.ledger_index >= self.read_through:
                self.metrics.sample_wait.observe(max(0, now_ms - at_ms) / 1000)
        self.read_through = max(self.read_through, batch.next_cursor)
        self.metrics.trainer_cursor.set(batch.next_cursor)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count a validator call as waiting (the queue-depth gauge) while it runs."""
        self.waiting_calls += 1
        self.metrics.queue.set(self.waiting_calls)
        try:
            yield
        finally:
            self.waiting_calls -= 1
            self.metrics.queue.set(self.waiting_calls)

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the validator's worker thread, counted as waiting."""
        with self.waiting(), self.refusing_when_full():
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    @contextlib.contextmanager
    def refusing_when_full(self) -> Iterator[None]:
        """A validator call that found the disk full becomes a STORAGE_FULL refusal (503),
        and the operator is told what to do, at most once a minute (``storage_full``)."""
        try:
            yield
        except Exception as exc:
            if not storage_full(exc):
                raise
            now = time.monotonic()
            if now - self._full_logged_at >= 60.0:
                self._full_logged_at = now
                LOG.error(
                    "disk full: %s. Free space on the disk of node.ledger, node.state_file "
                    "and node.blob_dir; until then every request that writes is refused with "
                    "503 storage_full and nothing is recorded",
                    exc,
                )
            raise ApiError(
                Reason.STORAGE_FULL,
                "the validator's disk is full: nothing was recorded; send the same request "
                "again later",
            ) from None

    async def body_of(self, request: Request) -> bytes:
        return await asgi_body(request.scope, request.receive, self.cfg.limits.max_body_bytes)

    def limit_rate(self, who: str) -> None:
        wait = self.buckets.take(who)
        if wait > 0:
            raise ApiError(Reason.RATE_LIMITED, f"rate limit: retry in {wait:.2f} s")

    async def caller(self, request: Request, body: bytes) -> PublicKey:
        """The key that signed this request (rate-limited per key)."""
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        key = verify_request(request.headers, request.method, target, body, self.clock_ms())
        self.limit_rate(key.hex())
        return key

    async def trainer_only(self, request: Request, body: bytes) -> None:
        key = await self.caller(request, body)
        if self.trainer is None or key != self.trainer:
            raise ApiError(Reason.UNAUTHORIZED, "only the trainer key may call this endpoint")


async def asgi_body(scope: Scope, receive: Receive, limit: int) -> bytes:
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
