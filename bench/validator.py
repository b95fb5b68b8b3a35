"""Validator benchmark: admission over loopback HTTP, spot-check cost, latency.

Prints progress on stderr and one JSON object on the last line of stdout:

  admitted_groups_per_s      groups admitted per second over HTTP on 127.0.0.1,
                             audit rate 0 (G envelopes of TOKENS tokens each): the median of
                             --repeats admission runs of --groups groups, one after another on
                             the same node
  admitted_envelopes_per_s   the same in envelopes
  envelope_verifies_per_s    trust-core verification (``verify_envelope``, one thread) of the
                             very envelopes submitted, same run: each admission run's envelopes
                             are verified in 3 passes just before it and 3 just after (the
                             machine's speed drifts), each timed like the admission run (wall
                             clock over the whole set); the median of all passes
  admission_ratio            each run's admitted envelopes/s over the verify rate of its own
                             passes; the median over the runs (target >= 0.5)
  admission_ratio_runs, admission_runs_at_target
                             every run's ratio, in order, and how many reach the target
  envelope_verifies_best_per_s, admission_ratio_vs_best
                             the same against the best of 7 short runs re-verifying one envelope
                             (the least-disturbed rate, best over the runs; stricter on a
                             loaded machine)
  cpu_affinity, node_cpus, precheck_cpus
                             whether the node pinned its threads and workers, and to which CPUs
                             (null where it did not)
  admission_p50_ms, admission_p99_ms
                             percentiles of submit latency seen by the clients, every run
  spotcheck_cost_ratio       spot-check time / generation time for the same rollouts on the same
                             model at the same batch (target <= 0.35): spotcheck_batch_groups
                             groups per call on both sides, as the groups waiting for a spot
                             check on a loaded node share a forward pass (audit_batch_mean_groups,
                             rounded; --spotcheck-batch sets it). The spot check is the node's
                             whole check: recomputation, logprob comparison, support check and
                             sampler replay on every token. The ratio of the two sides' fastest
                             of spotcheck_rounds alternated rounds; spotcheck_cost_baseline
                             names the baseline
  spotcheck_cost_ratio_single_group
                             the same, one group per call on both sides (an idle node)
  spotcheck_cost_ratio_rounds, spotcheck_cost_ratio_single_group_rounds, spotcheck_round_seconds
                             every round's ratio and each pass's seconds, in order
  spotcheck_load_average, spotcheck_cpu_busy
                             the machine's load averages before and after those rounds and the
                             share of its CPU busy during them
  audit_batch_mean_groups    groups per spot-check forward pass that a node formed by itself
                             while admitting honest groups over HTTP from --audited-clients
                             clients with every rollout audited (audited_groups_per_s)
  admission_cpu_busy         share of the machine's CPU busy during the admission runs (clients,
                             node and its precheck processes together; this and the figures
                             below are means over the runs)
  admission_cpu_stolen       share of the machine's CPU time its host gave to other guests during
                             the admission runs (a virtual machine's noise; 0 on bare metal)
  admission_cpu_ms_per_group CPU time per admitted group during the admission runs: the node's
                             own process (HTTP, admission), its precheck worker processes, the
                             load-generating clients (their request loops), and the rest of the
                             machine's busy time (kernel threads, other processes)
  admission_node_thread_cpu_ms_per_group
                             the node's share of that split by thread: its HTTP event loop
                             (request parsing, handing bodies to the precheck workers, answers),
                             its admission threads (checks, verdicts, the state and ledger
                             writes) and the rest of its process (Linux; null elsewhere)
  admission_thread_busy      share of each admission run's wall clock its admission threads spent
                             admitting batches, per thread (from the node's own /metrics: near 1,
                             admission is the node's bottleneck)
  admission_thread_on_cpu    share of that busy time the threads were on a CPU; the rest they
                             waited for fsyncs, the interpreter lock or a core
  admission_batch_mean_groups
                             groups per admission batch (one ledger transaction, its fsyncs)

Each client waits for its answer before sending its next group, so the
admission run offers as much load as there are clients: the default 8 keep a
two-core machine about 80% busy, and 16 or 32 admit about as much at two and
four times the latency (the node's process and its precheck worker then keep
both cores about as busy as they can). The clients send prebuilt requests and
parse answers minimally, so they take little of the CPU they share with the
node (``admission_cpu_ms_per_group``).

The node runs with --processes precheck worker processes and --threads admission threads
(``node.admission_processes`` and ``node.admission_threads``); the baseline is one thread.
With ``node.cpu_affinity`` on (the default; --no-cpu-affinity turns it off) and a CPU to
spare, each precheck worker runs on a CPU of its own and the node's threads on the others
(``node_cpus``, ``precheck_cpus``); the clients then run on the node's CPUs, leaving each
worker its CPU to itself, as on a real node whose contributors are elsewhere.

    python bench/validator.py [--groups 200] [--repeats 5] [--group-size 8] [--tokens 1024]
                              [--clients 8] [--processes 1] [--threads 1] [--no-cpu-affinity]
                              [--spotcheck-batch N] [--spotcheck-rounds 9]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._util import (  # noqa: E402
    alternated_rounds,
    best_rate,
    busy_fraction,
    cpu_ticks,
    emit,
    load_average,
    matched_ratio,
    process_cpu,
    thread_cpu,
)

ADMISSION_TARGET = 0.5
"""``admission_ratio`` a node must reach: half the envelopes one thread verifies, or more."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_dir(work: Path) -> Path:
    """The demo base model if it can be had, else a tiny random model."""
    try:
        from trainer.base_model import ensure_base_model

        return Path(ensure_base_model("arithmetic"))
    except Exception as exc:  # the benchmark still runs on a random model
        log(f"demo base model unavailable ({exc}); using a tiny random model")
        from harness.tiny_model import build_tiny_model

        return build_tiny_model(work / "tiny")


def make_validator(
    work: Path,
    model: Path,
    group_size: int,
    tokens: int,
    audit_rate: float = 0.0,  # type: ignore[no-untyped-def]
    node: dict | None = None,
):
    from ledger.log import Ledger
    from node.config import ValidatorConfig, load
    from node.validator.core import Validator
    from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
    from node.validator.state import StateStore
    from rewards.tasks.base import generate
    from rollout.oracle import TransformersOracle
    from verify.keys import SigningKey
    from verify.spotcheck import FLOAT32_TOLERANCE

    cfg = load(
        ValidatorConfig,
        None,
        {
            "assignment.group_size": group_size,
            "assignment.max_tokens": tokens,
            "rules.audit_rate": audit_rate,
            "audit.queue": 64,
            "limits.requests_per_s": 1e6,
            "assignment.max_outstanding": 1_024,  # groups are all assigned before any is sent
            "limits.burst": 1_000_000,
            "node.checkpoint_every": 1_000_000,
            **{f"node.{k}": value for k, value in (node or {}).items()},
        },
    )
    key = SigningKey.from_seed(b"\x01" * 32)
    codec = HFTextCodec(model)
    work.mkdir(parents=True, exist_ok=True)
    v = Validator(
        cfg,
        key,
        Ledger.open(work / "ledger.sqlite", signing_key=key, origin="bench"),
        StateStore(work / "state.sqlite"),
        codec,
        TransformersOracle({0: model}),
        generate("arithmetic", "train", 10_000),
        PolicyVersions(model_dir_digest(model)),
        FLOAT32_TOLERANCE,
    )
    return v, codec


def spread_groups(v, n: int, clients: int, first_seed: int, respond):  # type: ignore[no-untyped-def]
    """n groups from ``clients`` registered keys in turn: ``respond(key, sealed assignment)``
    gives each one's submission; returns each client's canonical bodies."""
    from verify.keys import SigningKey
    from verify.types import canonical_bytes

    keys = [SigningKey.from_seed(bytes([first_seed + i]) * 32) for i in range(clients)]
    for k in keys:
        v.register(k.public.raw, "bench")
    out: list[list[bytes]] = [[] for _ in keys]
    for i in range(n):
        k = keys[i % clients]
        out[i % clients].append(canonical_bytes(respond(k, v.assign(k.public.raw))))
    return out


def synthetic_groups(v, n: int, tokens: int, vocab: int, clients: int):  # type: ignore[no-untyped-def]
    """n signed groups of random in-vocabulary tokens, spread over ``clients`` keys."""
    from rollout.worker import header_fields, open_assignment
    from verify.envelope import build_envelope
    from verify.types import GroupSubmission

    rng = np.random.default_rng(0)

    def respond(k, sealed):  # type: ignore[no-untyped-def]
        a = open_assignment(sealed, v.key.public, k.public)
        envs = [
            build_envelope(
                k,
                header_fields(a, g, 0),
                rng.integers(4, vocab, tokens),
                -rng.exponential(1.0, tokens),
            )
            for g in range(a.group_size)
        ]
        return GroupSubmission(a.assignment_id, envs)

    return spread_groups(v, n, clients, 10, respond)


def honest_groups(v, model: Path, codec, n: int, clients: int):  # type: ignore[no-untyped-def]
    """n honest groups generated by the contributor code (every one passes a spot check)."""
    from rollout.backends import TransformersBackend
    from rollout.worker import answer

    backend = TransformersBackend(model)
    return spread_groups(
        v, n, clients, 40, lambda k, sealed: answer(k, sealed, v.key.public, backend, codec)
    )


def audited_admission(
    work: Path, model: Path, group_size: int, groups: int, clients: int, node: dict
) -> dict:
    """Honest groups over HTTP with every rollout audited: how many groups share a spot check.

    Every client submits real generations, the node spot-checks all of them,
    and the figure is the mean number of groups per spot-check forward pass
    the node formed on its own (its ``admission_threads`` bound it).
    """
    v, codec = make_validator(work, model, group_size, 32, audit_rate=1.0, node=node)
    per_client = honest_groups(v, model, codec, groups, clients)
    groups_per_s = admission(v, per_client, work).groups_per_s
    check_admitted(v, groups, group_size)
    audited = v.metrics.get("audit/groups", 0.0)
    batches = max(v.metrics.get("audit/batches", 0.0), 1.0)
    v.ledger.close()
    v.state.close()
    return {
        "audited_groups_per_s": round(groups_per_s, 1),
        "audited_groups": int(audited),
        "audit_batch_mean_groups": round(audited / batches, 2),
        "audit_clients": clients,
    }


@dataclass
class Admitted:
    """One admission run over HTTP."""

    groups_per_s: float
    latencies: list[float]
    """Every request's latency seen by its client, seconds."""
    busy: float | None
    """Share of the machine's CPU busy during the run (clients, node and its workers)."""
    stolen: float | None
    """Share of the machine's CPU its virtual machine's host gave elsewhere during the run."""
    cpu_ms_per_group: dict[str, float | None]
    """CPU per admitted group: the node's own process (HTTP and admission), its precheck
    worker processes, the load-generating clients, and the rest of the machine's busy time
    (kernel threads, other processes)."""
    node_thread_cpu_ms_per_group: dict[str, float | None]
    """The node's own CPU per admitted group split by thread: its HTTP event loop, its
    admission threads, and the rest of its process (other threads)."""
    admission_thread: dict[str, float | None]
    """From the node's /metrics over the run: ``busy``, the share of the run its admission
    threads spent admitting (per thread); ``on_cpu``, the share of that on a CPU;
    ``batch_mean_groups``, groups per admission batch."""
    cpus: tuple[list[int] | None, list[list[int]] | None] = (None, None)
    """The CPUs of the node's threads (and the clients') and of each precheck worker, as
    ``node.cpu_affinity`` placed them; None where nothing was pinned."""


def admission(v, per_client: list[list[bytes]], work: Path) -> Admitted:  # type: ignore[no-untyped-def]
    """Admit every client's bodies over HTTP, the clients running at once.

    Each client is its own process (as contributors are) holding one
    keep-alive connection, so the load generator does not share the
    validator's interpreter; the clock runs from the start signal until the
    last client has its last answer.
    """
    from node.validator.server import BackgroundServer, settle_heap, share_the_interpreter
    from node.validator.service import create_app

    groups = sum(len(b) for b in per_client)
    app = create_app(v)
    settle_heap()  # as ``prooftrain validator`` does once its app is built
    share_the_interpreter()
    with BackgroundServer(app) as url:
        procs = _start_clients(v, per_client, work, url)
        placed = v.placement
        _wait_ready(procs)
        run = _timed_run(procs, url)
    latencies = [t for report in run.reports for t in report["latencies"]]
    per_group, node_threads = _cpu_split(run)
    cpus = (
        (None, None)
        if placed is None
        else (sorted(placed.node), [sorted(w) for w in placed.workers])
    )
    return Admitted(
        groups / run.elapsed,
        latencies,
        run.busy,
        run.stolen,
        _ms_per_group(per_group, groups),
        _ms_per_group(node_threads, groups),
        _admission_thread(run),
        cpus,
    )


def _start_clients(v, per_client: list[list[bytes]], work: Path, url: str) -> list:  # type: ignore[no-untyped-def,type-arg]
    """One client process per list of bodies (written to ``work`` for it), each pinned to the
    node's CPUs when the node pinned its precheck workers."""
    import subprocess

    import msgspec

    from node.validator import affinity

    procs: list[subprocess.Popen] = []
    for i, bodies in enumerate(per_client):
        path = work / f"client{i}.msgpack"
        path.write_bytes(msgspec.msgpack.encode(bodies))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--client-of", url, "--bodies", str(path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        if v.placement is not None:  # off the precheck workers' CPUs, as if on other machines
            affinity.pin(v.placement.node, procs[-1].pid)
    return procs


def _wait_ready(procs: list) -> None:  # type: ignore[type-arg]
    for proc in procs:  # each says "ready" once its bodies are loaded and it is connected
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"


@dataclass
class _Run:
    """One admission run's raw measurements."""

    elapsed: float
    """Seconds from the start signal to the last client's last answer."""
    reports: list[dict]  # type: ignore[type-arg]
    """Each client's report (``latencies``, ``cpu_s``)."""
    busy: float | None
    stolen: float | None
    node_cpu: float
    """CPU seconds of the node's own process (this one)."""
    worker_cpu: float | None
    """CPU seconds of its precheck worker processes."""
    node_threads: dict[str, float | None]
    """CPU seconds of the node's threads by part (``_node_threads``)."""
    admitting: int
    """The node's admission threads (1 if none were found)."""
    counted: dict[str, float]
    """The node's admission counters (``_ADMISSION_COUNTERS``) over the run."""


def _timed_run(procs: list, url: str) -> _Run:  # type: ignore[type-arg]
    """Start every ready client at once and wait for each one's last answer, with the CPU
    counters of the machine, the node's threads and its worker processes read around it
    (and the node's own admission counters, off the clock)."""
    import multiprocessing

    workers = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
    threads = _node_threads()
    counted = _admission_counters(url)
    start, ticks, own = time.perf_counter(), cpu_ticks(), os.times()
    before = [process_cpu(pid) for pid in workers]
    threads_before = {part: [thread_cpu(t) for t in ids] for part, ids in threads.items()}
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    try:
        reports = [_report(proc) for proc in procs]  # each client's last answer is in
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    elapsed = time.perf_counter() - start
    after = [process_cpu(pid) for pid in workers]
    threads_after = {part: [thread_cpu(t) for t in ids] for part, ids in threads.items()}
    ticks_after = cpu_ticks()
    busy, stolen = busy_fraction(ticks, ticks_after), busy_fraction(ticks, ticks_after, stolen=True)
    spent = os.times()
    counted = {k: v - counted[k] for k, v in _admission_counters(url).items()}  # off the clock
    for proc in procs:  # let them exit, outside the clock
        proc.communicate()
    node_threads = {
        part: _spent(threads_before[part], threads_after[part]) if ids else None
        for part, ids in threads.items()
    }
    return _Run(
        elapsed,
        reports,
        busy,
        stolen,
        spent.user + spent.system - own.user - own.system,
        _spent(before, after),
        node_threads,
        len(threads["admission"]) or 1,
        counted,
    )


def _cpu_split(run: _Run) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """CPU seconds of the run by process (node, precheck workers, clients, the rest of the
    machine) and the node's by thread (with ``other`` for the rest of its process)."""
    client_cpu = 0.0
    for report in run.reports:
        client_cpu += report["cpu_s"]
    per_group: dict[str, float | None] = {
        "node": run.node_cpu,
        "precheck_workers": run.worker_cpu,
        "clients": client_cpu,
    }
    if (
        run.busy is not None and run.worker_cpu is not None
    ):  # the kernel's own threads, other processes
        machine = run.busy * (os.cpu_count() or 1) * run.elapsed
        per_group["rest_of_machine"] = machine - sum(t for t in per_group.values() if t is not None)
    node_threads = dict(run.node_threads)
    if all(t is not None for t in node_threads.values()):
        node_threads["other"] = run.node_cpu - sum(node_threads.values())  # type: ignore[arg-type]
    return per_group, node_threads


def _ms_per_group(seconds: dict[str, float | None], groups: int) -> dict[str, float | None]:
    return {k: None if t is None else round(1000 * t / groups, 3) for k, t in seconds.items()}


def _admission_thread(run: _Run) -> dict[str, float | None]:
    """``Admitted.admission_thread`` from the node's admission counters over the run."""
    counted = run.counted
    return {
        "busy": round(counted["busy"] / run.elapsed / run.admitting, 3),
        "on_cpu": round(counted["cpu"] / counted["busy"], 3) if counted["busy"] > 0 else None,
        "batch_mean_groups": round(counted["groups"] / counted["batches"], 2)
        if counted["batches"]
        else None,
    }


_ADMISSION_COUNTERS = {
    "busy": "prooftrain_verify_admission_busy_seconds_total",
    "cpu": "prooftrain_verify_admission_cpu_seconds_total",
    "batches": "prooftrain_verify_admission_batch_groups_count",
    "groups": "prooftrain_verify_admission_batch_groups_sum",
}


def _admission_counters(url: str) -> dict[str, float]:
    """The node's admission counters (``_ADMISSION_COUNTERS``) read from its /metrics."""
    from urllib.request import urlopen

    with urlopen(f"{url}/metrics", timeout=30) as answer:
        values = dict(
            line.rsplit(" ", 1)
            for line in answer.read().decode().splitlines()
            if line and not line.startswith("#")
        )
    return {k: float(values[name]) for k, name in _ADMISSION_COUNTERS.items()}


def _node_threads() -> dict[str, list[int]]:
    """The native ids of the node's HTTP event loop thread and its admission threads."""
    import threading

    found: dict[str, list[int]] = {"http_event_loop": [], "admission": []}
    for t in threading.enumerate():
        part = (
            "http_event_loop"
            if t.name == "validator-http"
            else "admission"
            if t.name.startswith("admit-")
            else None
        )
        if part is not None and t.native_id is not None:
            found[part].append(t.native_id)
    return found


def _spent(before: list[float | None], after: list[float | None]) -> float | None:
    """CPU seconds between two readings of the same processes or threads; None if any is missing."""
    if any(t is None for t in before + after):
        return None
    return sum(b - a for a, b in zip(before, after, strict=True))  # type: ignore[misc,operator]


def client(url: str, bodies_path: str) -> None:
    """One load-generating client: POST every body in order on one keep-alive connection.

    Every request's bytes are built before the start signal and the answers are
    read with a minimal HTTP/1.1 parser, so the client spends as little as it
    can of the CPU it shares with the node: like ``wrk``, it measures the
    server, not itself.
    """
    import json
    import socket
    from urllib.parse import urlsplit

    import msgspec

    bodies = msgspec.msgpack.decode(Path(bodies_path).read_bytes(), type=list[bytes])
    where = urlsplit(url)
    host = f"{where.hostname}:{where.port}"
    requests = [
        f"POST /v1/submit HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/msgpack\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
        for body in bodies
    ]
    sock = socket.create_connection((where.hostname, where.port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = _Replies(sock)
    print("ready", flush=True)
    sys.stdin.readline()
    latencies = []
    start_cpu = time.process_time()
    for request in requests:
        start = time.perf_counter()
        sock.sendall(request)
        status, data = reader.next()
        latencies.append(time.perf_counter() - start)
        if status != 200:
            print(f"HTTP {status}: {data[:500]!r}", flush=True)
            sys.exit(1)
    cpu = time.process_time() - start_cpu
    print(json.dumps({"latencies": latencies, "cpu_s": cpu}), flush=True)
    sys.stdin.read()  # the bench stops its clock before this client exits
    sock.close()


def _report(proc) -> dict:  # type: ignore[no-untyped-def]
    """A client's report, the line it prints once its last answer is in."""
    import msgspec

    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        rest = proc.communicate()[0]
        raise RuntimeError(f"a client failed: {(line + rest).strip()[-2_000:]}") from None


class _Replies:
    """HTTP/1.1 responses with a Content-Length, read one after another from a socket."""

    def __init__(self, sock) -> None:  # type: ignore[no-untyped-def]
        self.sock, self.buf = sock, b""

    def next(self) -> tuple[int, bytes]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._more()
        head, self.buf = self.buf[:end].decode("latin-1").split("\r\n"), self.buf[end + 4 :]
        fields = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])
        }
        if "content-length" not in fields:
            raise RuntimeError(f"a response without Content-Length: {head}")
        size = int(fields["content-length"])
        while len(self.buf) < size:
            self._more()
        body, self.buf = self.buf[:size], self.buf[size:]
        return int(head[0].split()[1]), body

    def _more(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the node closed the connection")
        self.buf += chunk


def check_admitted(v, groups: int, group_size: int) -> None:  # type: ignore[no-untyped-def]
    """Every envelope was admitted through the full pipeline: accepted verdicts in a ledger
    that passes ``audit verify``, and every accepted sample's body stored."""
    from ledger.audit import verify_ledger
    from ledger.records import VerdictRecorded

    verdicts = [r for _, r in v.ledger.entries() if isinstance(r, VerdictRecorded)]
    if len(verdicts) != groups * group_size or not all(r.accepted for r in verdicts):
        raise RuntimeError(
            f"expected {groups * group_size} accepted verdicts in the ledger, "
            f"found {sum(r.accepted for r in verdicts)} of {len(verdicts)}"
        )
    if any(v.state.sample(r.envelope_digest, r.assignment_id) is None for r in verdicts):
        raise RuntimeError("an accepted sample's body is missing")
    v.ledger.checkpoint()
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier, blobs=v.ledger.blobs)
    if not report.ok:
        raise RuntimeError(f"audit verify failed: {report.findings[:3]}")


SPOTCHECK_BASELINE = (
    "generation of the same rollouts at the same batch: spotcheck_batch_groups groups per "
    "TransformersBackend.generate_batch call against as many per spot_check_jobs call "
    "(one group per call on both sides for _single_group); the spot check is the node's "
    "whole check (recomputation, logprob comparison, support check, sampler replay on every "
    "token); each ratio is of the two sides' fastest of spotcheck_rounds alternated rounds"
)


def spotcheck_cost(
    model: Path,
    codec,  # type: ignore[no-untyped-def]
    group_size: int,
    batch: int,
    groups: int = 64,
    rounds: int = 9,
) -> dict:
    """Spot-check time over generation time for the same rollouts, at matched batch.

    Both sides take the same groups the same number per call: ``batch`` groups per call
    (``generate_batch`` against ``spot_check_jobs``: a loaded node, where the groups waiting
    for a spot check share one forward pass; ``batch`` is the mean batch a loaded node formed
    in :func:`audited_admission`), and one group per call (an idle node, a contributor
    generating one assignment at a time). The spot check is the node's whole check with its
    default ``audit.chunks_per_audit`` 0: recomputation, logprob comparison, support check and
    sampler replay on every token. The passes over ``groups`` groups alternate ``rounds``
    times after a warm-up, so each round's figures saw the same machine load; a ratio is of
    the two sides' fastest rounds, and every round is reported with the machine's load. Both
    sides run on one torch thread: per-core figures, with no oversubscription on a shared
    machine.
    """
    import torch

    groups = batch * max(1, round(groups / batch))  # whole batches only
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _spotcheck_cost(model, codec, group_size, batch, groups, rounds)
    finally:
        torch.set_num_threads(threads)


def _spotcheck_cost(
    model: Path,
    codec,  # type: ignore[no-untyped-def]
    group_size: int,
    batch: int,
    groups: int,
    rounds: int,
) -> dict:
    from node.validator.spot import SpotJob, spot_check_jobs
    from rewards.tasks.base import generate
    from rollout.backends import GenerationRequest, TransformersBackend
    from rollout.oracle import TransformersOracle
    from verify.envelope import build_envelope, verify_envelope
    from verify.keys import SigningKey
    from verify.spotcheck import FLOAT32_TOLERANCE
    from verify.types import SamplingParams

    backend = TransformersBackend(model)
    oracle = TransformersOracle({0: model})
    oracle.model(0)  # load before timing, as a running validator already has
    key = SigningKey.from_seed(b"\x02" * 32)
    secret = b"\x03" * 32
    requests: list[GenerationRequest] = []
    jobs: list[SpotJob] = []
    tokens = 0
    for i, problem in enumerate(generate("arithmetic", "train", groups, seed=9)):
        prompt = codec.encode(problem.prompt)
        nonce = bytes([i]) * 32
        req = GenerationRequest(
            tuple(prompt),
            group_size,
            1.0,
            0,
            1.0,
            32,
            key.public.raw,
            nonce,
            i,
            (codec.eos_token_id,),
        )
        rollouts = []
        for c in backend.generate(req):
            fields = dict(
                policy_version=0,
                manifest_digest=b"\0" * 32,
                task_id="arithmetic",
                prompt_id=problem.id,
                prompt_digest=b"\0" * 32,
                assignment_id=b"\0" * 16,
                nonce=nonce,
                sampling=SamplingParams(1.0, 1.0, 0, 32, i),
                group_index=c.group_index,
                group_size=group_size,
                created_at_ms=0,
            )
            rollouts.append(verify_envelope(build_envelope(key, fields, c.token_ids, c.logprobs)))
            tokens += len(c.token_ids)
        requests.append(req)
        jobs.append(SpotJob(rollouts, prompt, secret))

    def generation(size: int) -> None:
        for lo in range(0, len(requests), size):
            again = backend.generate_batch(requests[lo : lo + size])
            if size == 1:  # the verifiable sampler makes it the same group
                assert [c.token_ids for c in again[0]] == [
                    tuple(r.token_ids.tolist()) for r in jobs[lo].rollouts
                ]

    def check(size: int) -> None:
        for lo in range(0, len(jobs), size):
            for results in spot_check_jobs(jobs[lo : lo + size], oracle, 0, FLOAT32_TOLERANCE):
                assert not any(isinstance(r, Exception) for r in results)

    passes = {
        "generation_single_group": lambda: generation(1),
        "spotcheck_single_group": lambda: check(1),
    }
    if batch > 1:
        passes |= {"generation": lambda: generation(batch), "spotcheck": lambda: check(batch)}
    load_before, ticks = load_average(), cpu_ticks()
    seconds = alternated_rounds(passes, rounds)
    load_after = load_average()
    if batch == 1:
        seconds["generation"] = seconds["generation_single_group"]
        seconds["spotcheck"] = seconds["spotcheck_single_group"]
    ratio, ratio_rounds = matched_ratio(seconds, "spotcheck", "generation")
    single, single_rounds = matched_ratio(
        seconds, "spotcheck_single_group", "generation_single_group"
    )
    return {
        "spotcheck_cost_ratio": ratio,
        "spotcheck_cost_ratio_rounds": ratio_rounds,
        "spotcheck_cost_ratio_single_group": single,
        "spotcheck_cost_ratio_single_group_rounds": single_rounds,
        "spotcheck_cost_baseline": SPOTCHECK_BASELINE,
        "spotcheck_batch_groups": batch,
        "generation_s": round(min(seconds["generation"]), 4),
        "spotcheck_s": round(min(seconds["spotcheck"]), 4),
        "generation_single_group_s": round(min(seconds["generation_single_group"]), 4),
        "spotcheck_single_group_s": round(min(seconds["spotcheck_single_group"]), 4),
        "spotcheck_round_seconds": {k: [round(x, 4) for x in v] for k, v in seconds.items()},
        "spotcheck_load_average": {"before": load_before, "after": load_after},
        "spotcheck_cpu_busy": busy_fraction(ticks, cpu_ticks()),
        "spotcheck_chunks_per_audit": 0,
        "rollout_tokens": tokens,
        "spotcheck_groups": groups,
        "spotcheck_rounds": rounds,
    }


def _share(items: list, r: int, parts: int) -> list:  # type: ignore[type-arg]
    """The ``r``-th of ``parts`` consecutive, nearly equal slices of ``items``."""
    return items[len(items) * r // parts : len(items) * (r + 1) // parts]


def _mean(values: Iterable[float | None], digits: int = 3) -> float | None:
    """The mean of ``values``, None if any is missing."""
    got = list(values)
    return None if any(x is None for x in got) else round(statistics.fmean(got), digits)  # type: ignore[arg-type]


def _mean_split(splits: Iterable[dict[str, float | None]]) -> dict[str, float | None]:
    """Each part's mean over several runs' CPU splits (None where a run lacks it)."""
    runs = list(splits)
    return {part: _mean(run.get(part) for run in runs) for part in runs[0]}


def verify_times(envelopes: list, verify, passes: int = 3) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds each of ``passes`` timed passes takes to verify all ``envelopes`` in one thread."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for env in envelopes:
            verify(env)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.client_of:
        client(args.client_of, args.bodies)
        return
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.spotcheck_batch:
        spotcheck_only(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_dir(work)
        node = {
            "admission_processes": args.processes,
            "admission_threads": args.threads,
            "cpu_affinity": args.cpu_affinity,
        }
        v, codec = make_validator(work, model, args.group_size, args.tokens, node=node)
        log(
            f"signing {args.repeats} x {args.groups} groups of {args.group_size} x {args.tokens} tokens"
        )
        per_client = synthetic_groups(
            v, args.groups * args.repeats, args.tokens, codec.vocab_size, args.clients
        )
        bracketed = bracketed_admission(v, per_client, work, args.repeats, args.group_size)
        check_admitted(v, args.groups * args.repeats, args.group_size)
        v.ledger.close()
        v.state.close()
        log("admitting honest groups with every rollout audited")
        audited = audited_admission(
            work / "audited",
            model,
            args.group_size,
            args.audited_groups,
            args.audited_clients,
            node,
        )
        log("measuring spot-check cost against generation")
        batch = max(1, round(audited["audit_batch_mean_groups"]))
        cost = spotcheck_cost(model, codec, args.group_size, batch, rounds=args.spotcheck_rounds)
    emit(
        {
            **_admission_figures(args, bracketed),
            **cost,
            **audited,
            "spotcheck_cost_target": 0.35,
            "model": str(model),
        }
    )


def spotcheck_only(args: argparse.Namespace) -> None:
    """The spot-check cost alone, at ``--spotcheck-batch`` groups per call."""
    from node.validator.policy import HFTextCodec

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp))
        log(f"measuring spot-check cost against generation, {args.spotcheck_batch} groups a call")
        cost = spotcheck_cost(
            model,
            HFTextCodec(model),
            args.group_size,
            args.spotcheck_batch,
            rounds=args.spotcheck_rounds,
        )
    emit({**cost, "spotcheck_cost_target": 0.35, "model": str(model)})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=200, help="groups of each admission run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="admission runs on the same node, each bracketed by its own verify "
        "passes; the ratio printed is their median (one run of a few hundred "
        "groups swings by a third on a shared machine)",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--spotcheck-batch",
        type=int,
        default=0,
        help="measure the spot-check cost alone, at this many groups per call on both sides "
        "(default 0: the whole benchmark, at the batch its audited admission run formed)",
    )
    parser.add_argument(
        "--spotcheck-rounds",
        type=int,
        default=9,
        help="alternated timed rounds of the spot-check cost (each side's fastest is used)",
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument(
        "--clients",
        type=int,
        default=8,
        help="clients of the admission run, each with one request in flight: enough "
        "to keep a small node busy (16 or 32 admit about as much)",
    )
    parser.add_argument(
        "--audited-groups", type=int, default=96, help="honest groups of the audited admission run"
    )
    parser.add_argument(
        "--audited-clients", type=int, default=16, help="clients of the audited admission run"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="the node's admission_processes (precheck worker processes)",
    )
    parser.add_argument("--threads", type=int, default=1, help="the node's admission_threads")
    parser.add_argument(
        "--no-cpu-affinity",
        dest="cpu_affinity",
        action="store_false",
        help="the node's cpu_affinity off: its threads, its precheck workers and "
        "the clients go wherever the operating system puts them",
    )
    parser.add_argument("--client-of", help=argparse.SUPPRESS)
    parser.add_argument("--bodies", help=argparse.SUPPRESS)
    return parser


@dataclass
class Bracketed:
    """The admission runs, each bracketed by verify passes over its own envelopes."""

    runs: list[Admitted]
    ratios: list[float]
    """Each run's admitted envelopes/s over the verify rate of its own passes."""
    env_rate: float
    """Envelopes verified per second: the median over every pass of every run."""
    env_best: float
    """Envelopes verified per second, the best of the short runs re-verifying one envelope."""


def bracketed_admission(
    v,
    per_client: list[list[bytes]],
    work: Path,
    repeats: int,  # type: ignore[no-untyped-def]
    group_size: int,
) -> Bracketed:
    """``repeats`` admission runs on ``v``, each of its share of every client's bodies, with
    verify passes over the same envelopes just before and just after it."""
    from verify.envelope import verify_envelope
    from verify.types import GroupSubmission, decode

    runs: list[Admitted] = []
    ratios: list[float] = []
    verify_s: list[float] = []
    env_best = 0.0
    for r in range(repeats):
        bodies = [_share(b, r, repeats) for b in per_client]
        envelopes = [
            env
            for part in bodies
            for body in part
            for env in decode(GroupSubmission, body, max_bytes=1 << 26).envelopes
        ]
        passes = verify_times(envelopes, verify_envelope)
        env_best = max(env_best, best_rate(functools.partial(verify_envelope, envelopes[0]), 300))
        log(f"admitting over loopback HTTP ({r + 1}/{repeats})")
        run = admission(v, bodies, work)
        passes += verify_times(envelopes, verify_envelope)  # the machine drifts: bracket the run
        runs.append(run)
        ratios.append(run.groups_per_s * group_size / (len(envelopes) / statistics.median(passes)))
        verify_s += [t / len(envelopes) for t in passes]
    return Bracketed(runs, ratios, 1 / statistics.median(verify_s), env_best)


def _admission_figures(args: argparse.Namespace, bracketed: Bracketed) -> dict:  # type: ignore[type-arg]
    """The admission half of the printed JSON (see the module docstring)."""
    runs, ratios, env_best = bracketed.runs, bracketed.ratios, bracketed.env_best
    groups_per_s = statistics.median(run.groups_per_s for run in runs)
    placement = runs[-1].cpus
    envelopes_per_s = groups_per_s * args.group_size
    latencies = [t for run in runs for t in run.latencies]
    return {
        "bench": "validator",
        "groups": args.groups,
        "group_size": args.group_size,
        "tokens_per_rollout": args.tokens,
        "clients": args.clients,
        "admission_processes": args.processes,
        "admission_threads": args.threads,
        "cpu_affinity": args.cpu_affinity,
        "node_cpus": placement[0],
        "precheck_cpus": placement[1],
        "admission_runs": args.repeats,
        "admitted_groups_per_s": round(groups_per_s, 1),
        "admitted_envelopes_per_s": round(envelopes_per_s, 1),
        "envelope_verifies_per_s": round(bracketed.env_rate, 1),
        "admission_ratio": round(statistics.median(ratios), 3),
        "admission_ratio_runs": [round(x, 3) for x in ratios],
        "admission_runs_at_target": sum(x >= ADMISSION_TARGET for x in ratios),
        "envelope_verifies_best_per_s": round(env_best, 1),
        "admission_ratio_vs_best": round(envelopes_per_s / env_best, 3),
        "admission_ratio_target": ADMISSION_TARGET,
        "admission_p50_ms": round(1000 * float(np.percentile(latencies, 50)), 2),
        "admission_p99_ms": round(1000 * float(np.percentile(latencies, 99)), 2),
        "admission_cpu_busy": _mean(run.busy for run in runs),
        "admission_cpu_stolen": _mean(run.stolen for run in runs),
        "admission_cpu_ms_per_group": _mean_split(run.cpu_ms_per_group for run in runs),
        "admission_node_thread_cpu_ms_per_group": _mean_split(
            run.node_thread_cpu_ms_per_group for run in runs
        ),
        "admission_thread_busy": _mean(run.admission_thread["busy"] for run in runs),
        "admission_thread_on_cpu": _mean(run.admission_thread["on_cpu"] for run in runs),
        "admission_batch_mean_groups": _mean(
            (run.admission_thread["batch_mean_groups"] for run in runs), 2
        ),
    }


if __name__ == "__main__":
    main()
