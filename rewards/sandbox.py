"""Run an untrusted Python program in a separate, bounded, disposable process.

Isolation, outermost first (each holds even if the ones inside it fail):

* **Own process group and session** (``start_new_session``); at the end the
  whole group is SIGKILLed, then ``/proc`` is swept for any process still in
  the group or session or still running the program's runner (a ``setsid``
  escapee keeps the runner's command line, which names the temp dir).
* **Unprivileged user.** Started as root, the trusted runner drops to
  ``SandboxLimits.uid``/``gid`` (default 65534, ``nobody``, no supplementary
  groups) before the program runs: it cannot read root's files, signal the caller or
  read ``/proc/<caller>/environ``, and ``RLIMIT_NPROC`` binds (it does not
  bind root).
* **Resource limits** set by the trusted runner before the program starts:
  CPU seconds, address space, file size, process count, open files, no core.
  The caller also enforces a wall-clock limit.
* **Nothing inherited**: empty environment, stdin from ``/dev/null``, no
  open descriptors but stdout/stderr (files the caller reads back at most
  ``output_bytes`` of), cwd in a fresh temp dir that is deleted afterwards.
* **Guard** (:mod:`rewards.sandbox_runner`): an audit hook that ends the
  program on fork/exec/socket/native-code/out-of-tree file access.

Residual risks: native code that defeats the guard could write where the
unprivileged user may (``/tmp``), open sockets, or ``setsid`` + ``exec`` +
``chdir`` out of the sweep's sight; the native entry points are therefore
forbidden by the guard, and RLIMIT_NPROC caps what such a process could
leave. Programs run with the standard library only; after a privilege drop,
only the modules the runner pre-imports are guaranteed importable (the
interpreter may live where the unprivileged user cannot read).

The caller is never harmed: every outcome, including the child being killed
by a signal, becomes a :class:`RunResult`; nothing is raised for anything the
program does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rewards import sandbox_runner

VIOLATION_EXIT = sandbox_runner.VIOLATION_EXIT
TEMP_PREFIX = "prooftrain-sandbox-"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2
    """CPU time of the program (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    wall_seconds: float = 5.0
    """Wall-clock limit enforced by the caller (covers sleeping programs)."""
    memory_bytes: int = 512 * 2**20
    """Address-space limit (RLIMIT_AS); a larger allocation raises MemoryError."""
    file_bytes: int = 2**20
    """Largest file the program may write (RLIMIT_FSIZE), stdout included."""
    extra_processes: int = 8
    """Processes the sandbox user may add to those it already has (RLIMIT_NPROC)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    output_bytes: int = 65_536
    """How much of stdout the caller reads back; the rest is ignored."""
    guard: bool = True
    """Install the audit-hook guard; ``False`` leaves only the OS limits (for tests)."""
    uid: int = 65534
    """User to drop to when started as root."""
    gid: int = 65534
    """Group to drop to when started as root."""


@dataclass(frozen=True)
class RunResult:
    returncode: int | None
    """Exit status (negative: killed by that signal); ``None`` if the wall clock ran out."""
    timed_out: bool
    violation: bool
    """The guard stopped the program (an escape attempt)."""
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.violation


def _proc_entries() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat_fields(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, session) of ``pid`` from /proc, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[2]), int(rest[3])


def _count_tasks_of(uid: int) -> int:
    """Threads owned by ``uid`` (RLIMIT_NPROC counts threads, not processes)."""
    count = 0
    for pid in _proc_entries():
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Threads:"):
                count += int(line.split()[1])
                break
    return count


def _cmdline_has(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


KILL_SWEEP_S = 10.0
"""How long :func:`kill_tree` keeps sweeping: SIGKILLed processes exit as soon as the kernel
schedules them, which on a loaded machine can take well over a few milliseconds."""


def kill_tree(leader: int, marker: bytes) -> None:
    """SIGKILL the group of ``leader`` and sweep /proc until none of its processes runs
    (for at most :data:`KILL_SWEEP_S`)."""
    me = os.getpid()
    deadline = time.monotonic() + KILL_SWEEP_S
    while True:
        try:
            os.killpg(leader, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        alive = []
        for pid in _proc_entries():
            if pid == me:
                continue
            fields = _stat_fields(pid)
            if fields is None or fields[0] in ("Z", "X"):
                continue
            if leader in (fields[1], fields[2]) or _cmdline_has(pid, marker):
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _read_capped(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(limit)
    except OSError:
        return b""


def run_python(program: str, limits: SandboxLimits | None = None) -> RunResult:
    """Run ``program`` (Python source) under ``limits``; see the module docstring."""
    limits = limits or SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    try:
        return _run_in(root, program, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: Path, program: str, limits: SandboxLimits) -> RunResult:
    work = root / "work"
    work.mkdir()
    drop = os.geteuid() == 0
    uid = limits.uid if drop else os.geteuid()
    if drop:
        os.chown(work, limits.uid, limits.gid)
        os.chmod(root, 0o711)
    os.chmod(work, 0o700)
    read_roots = sorted(
        {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, str(root)}
        | {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
        | {os.path.dirname(os.__file__)}
    )
    cfg = {
        "cpu_seconds": limits.cpu_seconds,
        "memory_bytes": limits.memory_bytes,
        "file_bytes": limits.file_bytes,
        "nproc": _count_tasks_of(uid) + limits.extra_processes,
        "open_files": limits.open_files,
        "guard": limits.guard,
        "drop_to": [limits.uid, limits.gid] if drop else None,
        "work_dir": str(work),
        "read_roots": read_roots,
    }
    runner, cfg_path, prog_path = root / "runner.py", root / "config.json", root / "program.py"
    runner.write_text(Path(sandbox_runner.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    prog_path.write_text(program, encoding="utf-8")
    for p in (runner, cfg_path, prog_path):
        p.chmod(0o644)
    out_path, err_path = root / "stdout", root / "stderr"
    argv = [sys.executable, "-I", "-S", "-B", str(runner), str(cfg_path), str(prog_path)]
    timed_out = False
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=work,
            env={},
            close_fds=True,
            start_new_session=True,
            umask=0o077,
        )
        try:
            returncode: int | None = proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, None
        finally:
            kill_tree(proc.pid, str(root).encode())
            proc.wait()
    return RunResult(
        returncode=returncode,
        timed_out=timed_out,
        violation=returncode == VIOLATION_EXIT,
        stdout=_read_capped(out_path, limits.output_bytes),
        stderr=_read_capped(err_path, 4096),
    )
