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

The routes live in ``node.validator.routes``, one module per caller
(``public``, ``contributor``, ``trainer``); this module builds the app around
them: the state they share (``routes.common.Serving``), the error handlers,
the OpenAPI finish and the lifespan that starts and stops admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import platform
import time
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from starlette.types import Receive, Scope, Send

from node.validator import affinity
from node.validator.activity import ActivityLog
from node.validator.core import Validator
from node.validator.intake import AdmissionQueue
from node.validator.precheck import PrecheckPool
from node.validator.routes.common import (
    SECURITY_SCHEMES,
    ApiError,
    DirectRoute,
    Serving,
    api_error,
    domain_error,
    invalid_parameter,
)
from node.validator.routes.contributor import add_contributor_routes
from node.validator.routes.public import add_public_routes
from node.validator.routes.trainer import add_trainer_routes
from verify.errors import ConfigError, ProofTrainError
from verify.keys import PublicKey


def _finish_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Add the signature schemes; drop FastAPI's 422 (validation errors answer 400 ``ErrorBody``)."""
    components = spec.setdefault("components", {})
    components["securitySchemes"] = SECURITY_SCHEMES
    for schema in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(schema, None)
    for item in spec.get("paths", {}).values():
        for op in item.values():
            op.get("responses", {}).pop("422", None)
    return spec


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "prooftrain_http_requests_total",
            "HTTP requests answered, by route and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.verdicts = Counter(
            "prooftrain_verify_verdicts_total",
            "rollout verdicts",
            ["accepted", "reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "prooftrain_verify_admission_seconds", "submit latency", registry=self.registry
        )
        self.queue = Gauge(
            "prooftrain_verify_queue_depth", "validator calls waiting", registry=self.registry
        )
        self.ledger_size = Gauge("prooftrain_ledger_size", "ledger entries", registry=self.registry)
        self.policy_version = Gauge(
            "prooftrain_policy_version", "current policy version", registry=self.registry
        )
        self.audit_rate = Gauge(
            "prooftrain_verify_audit_rate",
            "fraction of the rollouts judged since the node started that were audited",
            registry=self.registry,
        )
        self.banned = Gauge(
            "prooftrain_reputation_banned", "contributors banned", registry=self.registry
        )
        self.prechecked = Counter(
            "prooftrain_verify_prechecked_total",
            "submissions verified and scored by a precheck worker process",
            registry=self.registry,
        )
        self.precheck_failures = Counter(
            "prooftrain_verify_precheck_failures_total",
            "submissions a precheck worker failed to answer (checked in process)",
            registry=self.registry,
        )
        self.batch_groups = Histogram(
            "prooftrain_verify_admission_batch_groups",
            "submissions admitted together in one batch",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.admitting = Counter(
            "prooftrain_verify_admission_busy_seconds",
            "wall-clock seconds the admission threads spent admitting batches "
            "(per second: how busy they are; near their number, admission is "
            "the node's bottleneck)",
            registry=self.registry,
        )
        self.admitting_cpu = Counter(
            "prooftrain_verify_admission_cpu_seconds",
            "CPU seconds the admission threads spent admitting batches "
            "(the rest of their busy time they waited: for fsyncs, the "
            "interpreter lock or a core)",
            registry=self.registry,
        )

        # -- what a dashboard of the node reads; no label takes more values than listed here
        self.contributors = Gauge(
            "prooftrain_contributors",
            "contributors by state: registered (ever), banned, active (a verdict in the "
            f"last {ACTIVE_WINDOW_S} seconds)",
            ["state"],
            registry=self.registry,
        )
        self.policy_published = Gauge(
            "prooftrain_policy_published_timestamp_seconds",
            "when the current policy version was published (version 0: when the log was created)",
            registry=self.registry,
        )
        self.policy_age = Gauge(
            "prooftrain_policy_age_seconds",
            "seconds since the current policy version was published",
            registry=self.registry,
        )
        self.checkpoint_size = Gauge(
            "prooftrain_ledger_checkpoint_size",
            "entries the latest signed checkpoint covers",
            registry=self.registry,
        )
        self.checkpoint_age = Gauge(
            "prooftrain_ledger_checkpoint_age_seconds",
            "seconds the oldest entry no signed checkpoint covers has waited for one "
            "(0: the latest checkpoint covers the whole log)",
            registry=self.registry,
        )
        self.sample_wait = Histogram(
            "prooftrain_trainer_sample_wait_seconds",
            "seconds from an accepted sample's verdict to the trainer's first read of it",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600),
            registry=self.registry,
        )
        self.trainer_cursor = Gauge(
            "prooftrain_trainer_cursor",
            "the ledger index the trainer's latest sample read reached (NaN: no read since start)",
            registry=self.registry,
        )
        self.trainer_lag = Gauge(
            "prooftrain_trainer_cursor_lag_entries",
            "ledger entries past the trainer's cursor (NaN: no read since start)",
            registry=self.registry,
        )
        self.storage_free = Gauge(
            "prooftrain_storage_free_bytes",
            "bytes free on the filesystem of each store the node writes (a SQLite ledger, "
            "node.state_file, node.blob_dir); a full one refuses writes with 503 storage_full",
            ["store"],
            registry=self.registry,
        )
        self.version_blob_bytes = Gauge(
            "prooftrain_policy_version_blob_bytes",
            "bytes of update blobs the current policy version added to node.blob_dir (its "
            "manifest's shard sizes; 0 for the base model): nothing is deleted, so with the "
            "publication rate this is how fast the blob store grows",
            registry=self.registry,
        )
        self.trainer_cursor.set(math.nan)
        self.trainer_lag.set(math.nan)
        Info("prooftrain_build", "the node's software", registry=self.registry).info(
            {"version": _version(), "python": platform.python_version()}
        )
        ProcessCollector(registry=self.registry)  # process_*: CPU, memory, open files, start
        PlatformCollector(registry=self.registry)  # python_info

    def admitted_batch(self, groups: int, wall_s: float, cpu_s: float) -> None:
        """One batch of ``groups`` submissions admitted in ``wall_s`` seconds, ``cpu_s`` on a CPU."""
        self.batch_groups.observe(groups)
        self.admitting.inc(wall_s)
        self.admitting_cpu.inc(cpu_s)


ACTIVE_WINDOW_S = 600
"""A contributor with a verdict this recent counts as active (``prooftrain_contributors``)."""


def _version() -> str:
    try:
        return metadata.version("prooftrain")
    except metadata.PackageNotFoundError:
        return "unknown"


def _unplace(
    validator: Validator, placement: affinity.Placement, threads: Sequence[int] = ()
) -> None:
    """The calling thread, and the threads ``threads`` names (native ids), back on every
    CPU they had before ``placement`` pinned them."""
    validator.placement = None
    affinity.pin(placement.everything)
    for thread in threads:
        affinity.pin(placement.everything, thread)


def create_app(
    validator: Validator,
    trainer: PublicKey | None = None,
    clock_ms: Callable[[], int] | None = None,
    admission_threads: int | None = None,
    summary_s: float = 30.0,
) -> FastAPI:
    """The FastAPI app around one validator; ``admission_threads`` (default: the validator's
    ``node.admission_threads``) admit submissions. While it serves, events and an admission
    summary every ``summary_s`` seconds are logged (``node.validator.activity``)."""
    threads = (
        validator.cfg.node.admission_threads if admission_threads is None else admission_threads
    )
    node = Serving(validator, trainer, Metrics(), clock_ms or (lambda: time.time_ns() // 1_000_000))
    app = _ValidatorApp(
        title="prooftrain validator",
        version="1",
        lifespan=lambda _: _serve(node, threads, summary_s),
        description="Assigns work, admits signed rollout groups, serves accepted samples.",
    )
    default_openapi = app.openapi
    app.openapi = lambda: app.openapi_schema or _finish_spec(default_openapi())  # type: ignore[method-assign]
    app.exception_handler(ApiError)(api_error)
    app.exception_handler(RequestValidationError)(invalid_parameter)
    app.exception_handler(ProofTrainError)(domain_error)
    add_public_routes(app, node)
    app.direct.update(add_contributor_routes(app, node))
    add_trainer_routes(app, node)
    app.count = lambda path, status: node.metrics.requests.labels(_route(path), str(status)).inc()
    app.state.validator = validator
    app.state.metrics = node.metrics
    return app


@contextlib.asynccontextmanager
async def _serve(node: Serving, threads: int, summary_s: float) -> AsyncIterator[None]:
    """The app's lifespan: admission runs (``threads`` admission threads, the precheck
    workers) while the app serves, and the activity log with it."""
    validator, cfg, metrics, running = node.validator, node.cfg, node.metrics, node.running
    # Undone in reverse: the admission queue closes first (admitting what it holds),
    # then the precheck workers, then the event loop's thread gets its CPUs back.
    with contextlib.ExitStack() as undo:
        # The event loop's thread runs this: pinned first, the admission threads, the
        # executor's and the workers' start inherit its CPUs (each worker is then moved to its own).
        before = affinity.allowed()
        placement = (
            affinity.plan(before, cfg.node.admission_processes)
            if cfg.node.cpu_affinity and before is not None
            else None
        )
        if placement is not None and affinity.pin(placement.node):
            validator.placement = placement
            undo.callback(_unplace, validator, placement, node.executor_threads)
        else:
            placement = None
        activity = ActivityLog(
            validator.ledger,
            metrics,
            lambda: node.waiting_calls,
            summary_s,
            clock_ms=node.clock_ms,
            active_window_s=ACTIVE_WINDOW_S,
        )
        activity.start()
        undo.callback(activity.stop)  # after the intake closes: its last entries are logged too
        undo.callback(lambda: running.pop("prechecks").close() if "prechecks" in running else None)
        running["intake"] = AdmissionQueue(
            lambda items: validator.admit_in_turn(
                [raw for raw, _ in items], [pre for _, pre in items]
            ),
            threads=max(1, threads),
            max_batch=cfg.audit.queue,
            observe=metrics.admitted_batch,
        )
        undo.callback(lambda: running.pop("intake").close())
        if cfg.node.admission_processes:
            try:
                running["prechecks"] = await asyncio.get_running_loop().run_in_executor(
                    node.executor,
                    lambda: PrecheckPool(
                        cfg.node.admission_processes,
                        validator.limits,
                        validator.codec,
                        cpus=placement.workers if placement else None,
                    ),
                )
            except Exception as exc:
                raise ConfigError(
                    f"node.admission_processes: the precheck workers did not start: {exc}"
                ) from exc
        yield


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
        self.direct: dict[tuple[str, str], DirectRoute] = {}
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


_ROUTES = (
    "/healthz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/v1/info",
    "/v1/register",
    "/v1/assign",
    "/v1/submit",
    "/v1/policy",
    "/v1/trainer/evals",
    "/v1/trainer/eval",
    "/v1/blobs",
    "/v1/samples",
)


def _route(path: str) -> str:
    """The route a path belongs to (``/v1/policy/3`` -> ``/v1/policy``); "other" for any
    path the node does not serve, so unknown paths cannot grow the label set."""
    for route in _ROUTES:
        if path == route or path.startswith(route + "/"):
            return route
    return "other"
