"""Trusted prologue of every sandboxed program (copied next to it and run with ``python -I -S -B``).

Runs before a single line of untrusted code:

1. read the config and the program text (the only reads outside the work dir);
2. set the resource limits (CPU, address space, file size, processes, files,
   no core dumps);
3. if started as root, import the common pure-Python stdlib modules (the
   interpreter may live where the unprivileged user cannot read, such as a
   pyenv under ``/root``), then drop to the configured uid/gid with no
   supplementary groups and check that the drop took (a failed drop exits
   with :data:`LIMIT_FAILURE_EXIT`; untrusted code never runs as root).
   ``RLIMIT_NPROC`` binds from here on: it never binds uid 0;
4. install the guard, an audit hook that ends the process with
   :data:`VIOLATION_EXIT` on any attempt to fork, exec, open a socket, load
   native code, walk the garbage collector, signal a process, or open, create
   or remove a file outside the allowed roots (write: the work dir only).
   Audit hooks cannot be removed; the hook exits at once (``os._exit``), so an
   untrusted ``try/except`` cannot swallow it;
5. compile and run the program with ``__name__ == "__main__"``.

The guard is defence in depth, not the boundary: CPython's audit hooks can in
principle be bypassed by native code, which is why native-code entry points
(``ctypes``, ``mmap``) are themselves forbidden and why the OS limits set in
steps 2-3 and the parent's process-group kill hold regardless. Stdlib only.
"""

import json
import os
import resource
import sys

VIOLATION_EXIT = 113
LIMIT_FAILURE_EXIT = 114

_BLOCKED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "socket.sendto",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
        "mmap.__new__",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys._current_frames",
        "os.chdir",
        "os.chroot",
        "os.symlink",
        "os.link",
        "os.chmod",
        "os.chown",
        "os.chflags",
        "os.putenv",
        "os.unsetenv",
        "os.setxattr",
        "os.removexattr",
        "sys.remote_exec",
        "_posixsubprocess.fork_exec",
    }  # fmt: skip
)
_BLOCKED_MODULES = frozenset({"ctypes", "_ctypes", "mmap", "_posixsubprocess", "pty", "fcntl"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
    "shutil.copyfile": (1,), "shutil.copytree": (1,), "os.mkfifo": (0,), "os.mknod": (0,),
}  # fmt: skip
_PRELOAD = (
    "math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "re",
    "string", "json", "fractions", "decimal", "statistics", "random", "operator", "typing",
    "dataclasses", "copy", "array", "enum", "numbers", "textwrap", "unicodedata", "time",
)  # fmt: skip
_DEVICES = frozenset({"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero"})


def _set_limits(cfg):
    mem, cpu = int(cfg["memory_bytes"]), int(cfg["cpu_seconds"])
    limits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_FSIZE, int(cfg["file_bytes"]), int(cfg["file_bytes"])),
        (resource.RLIMIT_NPROC, int(cfg["nproc"]), int(cfg["nproc"])),
        (resource.RLIMIT_NOFILE, int(cfg["open_files"]), int(cfg["open_files"])),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _drop_privileges(uid, gid):
    for name in _PRELOAD:
        __import__(name)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid or os.getgroups():
        raise OSError("privilege drop did not take")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise OSError("root could be regained after the drop")


def _install_guard(write_root, read_roots):
    write_root = os.path.realpath(write_root)
    read_roots = tuple(os.path.realpath(r) for r in read_roots) + (write_root,)
    blocked, blocked_modules, path_events = _BLOCKED_EVENTS, _BLOCKED_MODULES, _PATH_EVENTS
    realpath, fspath, exit_now = os.path.realpath, os.fspath, os._exit

    def under(path, roots):
        p = realpath(
            fspath(path) if not isinstance(path, bytes) else path.decode("utf-8", "replace")
        )
        return any(p == r or p.startswith(r + os.sep) for r in roots) or p in _DEVICES

    def hook(event, args):
        try:
            if event in blocked:
                exit_now(VIOLATION_EXIT)
            if event == "import" and args[0].partition(".")[0] in blocked_modules:
                exit_now(VIOLATION_EXIT)
            if event == "open":
                path, mode, flags = args
                if isinstance(path, int):
                    return
                writes = (mode is not None and any(c in mode for c in "wax+")) or (
                    flags is not None and flags & _WRITE_FLAGS
                )
                if not under(path, (write_root,) if writes else read_roots):
                    exit_now(VIOLATION_EXIT)
            elif event in ("os.listdir", "os.scandir"):
                if (
                    args[0] is not None
                    and not isinstance(args[0], int)
                    and not under(args[0], read_roots)
                ):
                    exit_now(VIOLATION_EXIT)
            elif event in path_events:
                for i in path_events[event]:
                    if not isinstance(args[i], int) and not under(args[i], (write_root,)):
                        exit_now(VIOLATION_EXIT)
        except BaseException:  # noqa: BLE001 - any surprise inside the guard fails closed
            exit_now(VIOLATION_EXIT)

    sys.addaudithook(hook)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        cfg = json.load(f)
    with open(sys.argv[2], encoding="utf-8") as f:
        source = f.read()
    try:
        _set_limits(cfg)
        if cfg["drop_to"] is not None:
            _drop_privileges(*cfg["drop_to"])
    except (OSError, ValueError, ImportError):
        os._exit(LIMIT_FAILURE_EXIT)
    code = compile(source, "<program>", "exec")
    if cfg["guard"]:
        _install_guard(cfg["work_dir"], cfg["read_roots"])
    del cfg, source
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
