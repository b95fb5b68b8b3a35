"""Routes anyone may call, unsigned: health, metrics, node info, and the public reads of
what the ledger and the blob store hold (policy manifests, recorded evals, blobs)."""

from __future__ import annotations

import math
import pathlib
import shutil
from typing import Annotated, Any

from fastapi import FastAPI, Path, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ledger.reputation import PROBATION_ROLLOUTS, PROBATION_WEIGHT
from node.config import NodeSection
from node.validator import trainer_side
from node.validator.routes.common import INT64_MAX, MSGPACK, ApiError, Serving, errors, ok_binary
from verify.errors import Reason
from verify.types import PolicyManifest, SignedManifest, decode


def storage_paths(cfg: NodeSection) -> dict[str, pathlib.Path]:
    """The stores a node writes on its own disks, by the name ``prooftrain_storage_free_bytes``
    gives them (a PostgreSQL ledger is on its server's)."""
    paths = {"state_file": cfg.state_path(), "blob_dir": cfg.blob_path()}
    if (ledger := cfg.ledger_path()) is not None:
        paths["ledger"] = ledger
    return paths


def free_bytes(path: pathlib.Path) -> float:
    """Bytes free on the filesystem that holds ``path`` (or would: its nearest existing
    parent); NaN when none can be read."""
    for place in (path, *path.absolute().parents):
        if place.exists():
            try:
                return float(shutil.disk_usage(place).free)
            except OSError:
                return math.nan
    return math.nan


def manifest_blob_bytes(sealed: bytes) -> int:
    """The update blob bytes a stored signed manifest names (its shards' sizes)."""
    signed = decode(SignedManifest, sealed, max_bytes=len(sealed))
    manifest = decode(PolicyManifest, signed.manifest, max_bytes=len(signed.manifest))
    return sum(shard.nbytes for shard in manifest.shards)


def add_public_routes(app: FastAPI, node: Serving) -> None:
    """``GET /healthz``, ``/metrics``, ``/v1/info``, ``/v1/policy/{version}``,
    ``/v1/trainer/evals`` and ``/v1/blobs/{digest}``."""
    validator, metrics, call = node.validator, node.metrics, node.call
    cfg, a = node.cfg, node.cfg.assignment
    network = {  # what the node fixes for everyone: trainers and contributors read it, never repeat it
        "base_model_digest": validator.versions.base_digest.hex(),
        "task": cfg.task.name,
        "rules": cfg.rules.model_dump(),
        "group_size": a.group_size,
        "temperature": a.temperature,
        "top_p": a.top_p,
        "top_k": a.top_k,
        "max_tokens": a.max_tokens,
        "chunk_size": a.chunk_size,
        "max_outstanding": a.max_outstanding,
        "max_prompt_share": a.max_prompt_share,
        "registration": {
            "work_bits": cfg.registration.work_bits,
            "work_log2_n": cfg.registration.work_log2_n,
            "probation_rollouts": PROBATION_ROLLOUTS,
            "probation_weight": PROBATION_WEIGHT,
        },
    }

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        size = await call(validator.ledger.size)
        await call(validator.follow)
        metrics.ledger_size.set(size)
        return {"ok": True, "ledger_size": size, "policy_version": validator.versions.current}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def prometheus() -> Response:
        size = await call(validator.ledger.size)
        metrics.ledger_size.set(size)  # what /healthz says, now
        metrics.policy_version.set(validator.versions.current)
        if node.read_through:
            metrics.trainer_lag.set(size - node.read_through)
        for store, path in storage_paths(node.cfg.node).items():
            metrics.storage_free.labels(store).set(free_bytes(path))
        current = validator.versions.current
        sealed = await call(lambda: validator.state.manifest(current)) if current else None
        metrics.version_blob_bytes.set(0 if sealed is None else manifest_blob_bytes(sealed))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        await call(validator.follow)  # a version another node of the log published
        cp = await call(validator.ledger.latest_checkpoint)
        return {
            "validator_key": validator.key.public.hex(),
            "origin": validator.ledger.origin,
            "policy_version": validator.versions.current,
            # where a trainer without a checkpoint resumes its sample cursor (after this entry)
            "policy_index": validator.versions.ledger_index(validator.versions.current),
            "trainer_key": node.trainer.hex() if node.trainer else None,
            "checkpoint": cp.to_text() if cp else None,
            "network": network,
        }

    @app.get(
        "/v1/policy/{version}",
        response_class=Response,
        responses={**ok_binary(MSGPACK, "msgpack SignedManifest"), **errors(400, 404)},
    )
    async def get_policy(version: Annotated[int, Path(ge=0, le=INT64_MAX)]) -> Response:
        data = await call(lambda: validator.state.manifest(version))
        if data is None:
            raise ApiError(Reason.NOT_FOUND, f"no manifest for policy version {version}")
        return Response(data, media_type=MSGPACK)

    @app.get("/v1/trainer/evals")
    async def get_evals() -> dict[str, list[int]]:
        """Versions with an eval recorded by the trainer key (the ledger is public: no signature)."""
        return {
            "versions": await call(
                lambda: trainer_side.recorded_evals(validator.ledger, node.trainer)
            )
        }

    @app.get(
        "/v1/blobs/{digest}",
        response_class=Response,
        responses={**ok_binary("application/octet-stream", "the blob's bytes"), **errors(400, 404)},
    )
    async def get_blob(
        digest: Annotated[str, Path(min_length=64, max_length=64, pattern="^[0-9a-fA-F]{64}$")],
    ) -> Response:
        blobs = validator.ledger.blobs
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            raise ApiError(Reason.MALFORMED, "digest must be 64 hex digits") from None
        if blobs is None or len(raw) != 32 or not blobs.has(raw):
            raise ApiError(Reason.NOT_FOUND, "no such blob")
        return Response(blobs.get(raw), media_type="application/octet-stream")
