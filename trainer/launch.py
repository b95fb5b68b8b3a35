"""Start an S-stage pipeline job: one process per stage, all on 127.0.0.1.

Two ways in:
- :func:`torchrun_command` / :func:`run_torchrun` build and run
  ``python -m torch.distributed.run --nproc-per-node S --max-restarts R ...``;
  torchrun restarts every stage when one dies, and the entry point resumes from
  its last checkpoint (``TORCHELASTIC_RESTART_COUNT`` tells it which attempt
  this is).
- :func:`spawn` runs a picklable function on S ``torch.multiprocessing``
  processes and returns each rank's result (tests, single-host tools).

Every process calls :func:`init_distributed`, which picks gloo on CPU and NCCL
on GPU and always sets a timeout, so a lost peer ends a collective with an
error instead of a hang.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verify.errors import ConfigError, ProofTrainError

LOCALHOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]


class LaunchError(ProofTrainError):
    """A stage process failed, hung past its deadline, or torchrun gave up."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def init_distributed(timeout_s: float = 60.0, backend: str | None = None) -> tuple[int, int]:
    """Join the process group described by the torchrun environment; returns (rank, world).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``. ``backend`` defaults to NCCL when CUDA is available, else gloo.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise ConfigError(f"not started by torchrun or spawn(): {', '.join(missing)} unset")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return rank, world


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
    backend: str,
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR=LOCALHOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        init_distributed(timeout_s, backend)
        out = fn(rank, world, *args)
        # Bytes, not tensors: a tensor on a queue is a shared-memory handle that
        # dies with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    group_timeout_s: float = 30.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes; return results by rank.

    ``fn`` must be picklable; its result may hold tensors, numbers, strings,
    lists and dicts. Raises :class:`LaunchError` with
    every failing rank's traceback, or when the job outlives ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world, port, fn, tuple(args), group_timeout_s, backend, results),
            daemon=False,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(
                    f"{world - len(got)} of {world} ranks still running after {timeout_s}s"
                )
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise LaunchError(f"ranks {dead} exited without a result") from None
                continue
            got[rank] = (ok, out)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: out for r, (ok, out) in got.items() if not ok}
    if failed:
        detail = "\n".join(f"--- rank {r}\n{tb}" for r, tb in sorted(failed.items()))
        raise LaunchError(f"ranks {sorted(failed)} failed:\n{detail}")
    # The bytes come from the children this call started, running ``fn``.
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world)]


def torchrun_command(
    target: str,
    nproc: int,
    *,
    args: Sequence[str] = (),
    max_restarts: int = 0,
    port: int | None = None,
    module: bool = True,
) -> list[str]:
    """The torchrun command line for ``nproc`` stages of ``target`` on 127.0.0.1.

    ``target`` is a module name (``module=True``, run with ``-m``) or a script path.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        # c10d rendezvous: each restart round gets a fresh store namespace.
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{LOCALHOST}:{port if port is not None else free_port()}",
        "--local-addr",
        LOCALHOST,
    ]
    cmd += ["-m", target] if module else [target]
    return cmd + list(args)


def torchrun_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a torchrun job needs to restart cleanly on one host.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes each restart round use a fresh
    store hosted by its rank 0; with the agent's shared store a restarted rank can
    read the previous round's gloo addresses and fail to connect.
    """
    full = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full.get("PYTHONPATH", "")) if p
    )
    return full


def run_torchrun(
    target: str,
    nproc: int,
    *,
    args: Sequence[str] = (),
    max_restarts: int = 0,
    timeout_s: float = 300.0,
    module: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a torchrun job to completion; raise :class:`LaunchError` if it fails or overruns.

    On timeout torchrun gets SIGTERM (it stops its workers), then its whole
    process group gets SIGKILL.
    """
    cmd = torchrun_command(target, nproc, args=args, max_restarts=max_restarts, module=module)
    proc = subprocess.Popen(
        cmd,
        env=torchrun_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise LaunchError(f"torchrun did not finish within {timeout_s}s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        raise LaunchError(f"torchrun exited {proc.returncode}:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
