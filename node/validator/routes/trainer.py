"""Routes only the trainer key may call (signed): publish a policy version, record an
eval, store a blob, and read the accepted samples by cursor."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Query, Request, Response

from node.validator.routes.common import (
    INT64_MAX,
    MSGPACK,
    SIGNED,
    ApiError,
    Serving,
    binary,
    errors,
    ok_binary,
)
from verify.errors import Reason
from verify.types import SignedEvalStatement, SignedManifest, canonical_bytes, decode


def add_trainer_routes(app: FastAPI, node: Serving) -> None:
    """``POST /v1/policy``, ``/v1/trainer/eval`` and ``/v1/blobs``, and ``GET /v1/samples``."""
    validator, max_body = node.validator, node.cfg.limits.max_body_bytes

    @app.post(
        "/v1/policy",
        responses=errors(400, 401, 403, 404, 409, 413, 429, 503),
        openapi_extra={
            "security": SIGNED,
            "requestBody": {"required": True, "content": binary(MSGPACK, max_body)},
        },
    )
    async def post_policy(request: Request) -> dict[str, int]:
        body = await node.body_of(request)
        await node.trainer_only(request, body)
        sealed = decode(SignedManifest, body, max_bytes=len(body))
        return {"version": await node.call(lambda: validator.publish_policy(sealed))}

    @app.post(
        "/v1/trainer/eval",
        responses=errors(400, 401, 403, 404, 409, 413, 429, 503),
        openapi_extra={
            "security": SIGNED,
            "requestBody": {"required": True, "content": binary(MSGPACK, max_body)},
        },
    )
    async def post_eval(request: Request) -> dict[str, int]:
        body = await node.body_of(request)
        await node.trainer_only(request, body)
        sealed = decode(SignedEvalStatement, body, max_bytes=len(body))
        return {"index": await node.call(lambda: validator.record_eval(sealed))}

    @app.post(
        "/v1/blobs",
        responses=errors(400, 401, 413, 429, 503),
        openapi_extra={
            "security": SIGNED,
            "requestBody": {
                "required": True,
                "content": binary("application/octet-stream", max_body),
            },
        },
    )
    async def post_blob(request: Request) -> dict[str, str]:
        body = await node.body_of(request)
        await node.trainer_only(request, body)
        if validator.ledger.blobs is None:
            raise ApiError(Reason.MALFORMED, "this validator has no blob store")
        with node.refusing_when_full():
            return {"digest": validator.ledger.blobs.put(body).hex()}

    @app.get(
        "/v1/samples",
        response_class=Response,
        openapi_extra={"security": SIGNED},
        responses={**ok_binary(MSGPACK, "msgpack SampleBatch"), **errors(400, 401, 429)},
    )
    async def samples(
        request: Request,
        cursor: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
        limit: Annotated[int, Query(ge=1, le=4_096)] = 256,
    ) -> Response:
        await node.trainer_only(request, b"")
        if cursor < 0 or not 1 <= limit <= 4_096:
            raise ApiError(Reason.MALFORMED, "cursor must be >= 0 and limit in [1, 4096]")
        times: list[int] = []
        batch = await node.call(lambda: validator.samples(cursor, limit, times))
        node.samples_read(batch, times)
        return Response(canonical_bytes(batch), media_type=MSGPACK)
