"""Routes contributors call: register a key and take an assignment (both signed), and
submit a rollout group (unsigned: every envelope in it is signed).

A submission is the node's most frequent request: besides its declared route,
``POST /v1/submit`` is served directly on the ASGI messages (``submit_direct``,
see ``service._ValidatorApp``) with the same handling and error handlers.
Submissions wait in the admission queue (``node.validator.intake``), verified
and scored first by a precheck worker process when the node has them; when
``audit.queue`` validator calls are already waiting they get BACKPRESSURE (429).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from node.validator.core import SubmitResult
from node.validator.precheck import Prechecked, PrecheckPool
from node.validator.routes.common import (
    MSGPACK,
    MSGPACK_BYTES,
    SIGNED,
    ApiError,
    DirectRoute,
    Serving,
    api_error,
    asgi_body,
    binary,
    domain_error,
    errors,
    ok_binary,
)
from verify.errors import ProofTrainError, Reason
from verify.types import canonical_bytes


def add_contributor_routes(app: FastAPI, node: Serving) -> dict[tuple[str, str], DirectRoute]:
    """``POST /v1/register``, ``/v1/assign`` and ``/v1/submit``; returns the routes to serve
    directly ((method, path) -> ASGI app)."""
    validator, max_body = node.validator, node.cfg.limits.max_body_bytes

    @app.post(
        "/v1/register",
        responses=errors(400, 401, 403, 413, 429, 503),
        openapi_extra={
            "security": SIGNED,
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "maxLength": 256},
                                "work": {
                                    "type": "integer",
                                    "minimum": 0,
                                    "maximum": 2**63 - 1,
                                    "description": "registration proof-of-work nonce "
                                    "(verify.registration), when /v1/info asks for one",
                                },
                            },
                        }
                    }
                },
            },
        },
    )
    async def register(request: Request) -> dict[str, Any]:
        body = await node.body_of(request)
        key = await node.caller(request, body)
        try:
            fields = msgspec.json.decode(body or b"{}")
            name, work = fields.get("name", ""), fields.get("work", 0)
        except (msgspec.DecodeError, AttributeError):
            name = work = None
        if (  # as declared: a string of at most 256 characters, and a nonce if any
            not isinstance(name, str)
            or len(name) > 256
            or isinstance(work, bool)
            or not (isinstance(work, int) and 0 <= work < 2**63)
        ):
            raise ApiError(
                Reason.MALFORMED,
                'body must be JSON {"name": "<at most 256 characters>", "work": <nonce>}',
            )
        nonce = work if "work" in fields else None
        added = await node.call(lambda: validator.register(key.raw, name, nonce))
        return {"registered": added, "fingerprint": key.fingerprint}

    @app.post(
        "/v1/assign",
        response_class=Response,
        openapi_extra={"security": SIGNED},
        responses={
            **ok_binary(MSGPACK, "msgpack SignedAssignment"),
            **errors(400, 401, 403, 413, 429, 503),
        },
    )
    async def assign(request: Request) -> Response:
        body = await node.body_of(request)
        key = await node.caller(request, body)
        sealed = await node.call(lambda: validator.assign(key.raw))
        return Response(canonical_bytes(sealed), media_type=MSGPACK)

    @app.post(
        "/v1/submit",
        response_class=Response,
        openapi_extra={"requestBody": {"required": True, "content": binary(MSGPACK, max_body)}},
        responses={
            **ok_binary(MSGPACK, "msgpack SignedGroupVerdict"),
            **errors(400, 403, 404, 409, 413, 429, 503),
        },
    )
    async def submit(request: Request) -> Response:
        body = await node.body_of(request)
        return Response(
            await answer_to(node, body, request.client.host if request.client else "?"),
            media_type=MSGPACK,
        )

    async def submit_direct(scope: Scope, receive: Receive, send: Send) -> None:
        """``submit`` with its error handlers, on the ASGI messages themselves: no request,
        response or routing objects in between (the answer's headers are a ``Response``'s)."""
        try:
            body = await asgi_body(scope, receive, max_body)
            client = scope.get("client")
            data = await answer_to(node, body, client[0] if client else "?")
        except ClientDisconnect:
            return
        except ApiError as exc:
            await (await api_error(Request(scope, receive), exc))(scope, receive, send)
            return
        except ProofTrainError as exc:
            await (await domain_error(Request(scope, receive), exc))(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-length", str(len(data)).encode()),
                    (b"content-type", MSGPACK_BYTES),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    return {("POST", "/v1/submit"): submit_direct}


async def answer_to(node: Serving, body: bytes, host: str) -> bytes:
    """The msgpack ``SignedGroupVerdict`` answering a submitted group (both routes)."""
    node.limit_rate(f"ip:{host}")
    start = time.perf_counter()
    result = await admitted(node, body)
    node.metrics.latency.observe(time.perf_counter() - start)
    if result.fresh:
        for reason, count in collections.Counter(result.reasons).items():
            node.metrics.verdicts.labels(str(not reason).lower(), reason or "accepted").inc(count)
    return canonical_bytes(result.answer)


async def admitted(node: Serving, body: bytes) -> SubmitResult:
    """The submission through the admission queue; BACKPRESSURE when ``audit.queue`` calls wait."""
    if node.waiting_calls >= node.cfg.audit.queue:
        raise ApiError(Reason.BACKPRESSURE, "audit queue is full")
    with node.waiting(), node.refusing_when_full():
        pre = await prechecked(node, body)
        return await asyncio.wrap_future(node.running["intake"].submit((body, pre)))  # type: ignore[no-any-return]


async def prechecked(node: Serving, body: bytes) -> Prechecked | None:
    """The submission verified and scored by a worker process, when the node has them."""
    pool: PrecheckPool | None = node.running.get("prechecks")
    job = node.validator.precheck_job(body) if pool is not None else None
    if pool is None or job is None:
        return None
    try:
        pre = await pool.check(body, *job)
    except Exception:  # noqa: BLE001 - a lost worker: the admission thread does the work itself
        node.metrics.precheck_failures.inc()
        return None
    node.metrics.prechecked.inc()
    return pre
