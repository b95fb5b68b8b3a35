"""Running the validator app: as the node's process until a signal stops it (``serve_node``),
in a background thread with uvicorn (tests, harness, benchmarks), and the process and server
settings a node starts with."""

from __future__ import annotations

import errno
import gc
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from verify.errors import ConfigError

if TYPE_CHECKING:  # imported where used: a precheck worker takes settle_heap from here
    import uvicorn
    from fastapi import FastAPI

    from node.config import ValidatorConfig
    from node.validator.core import Validator

LOG = logging.getLogger("prooftrain.validator")

SWITCH_INTERVAL_S = 0.001
"""How long a thread holding the interpreter lock may run while another waits for it."""


def share_the_interpreter() -> None:
    """Let the node's threads take turns every millisecond, not every 5 (CPython's default).

    The event loop and the admission thread share one interpreter lock, and
    the admission thread lets go of it at every SQLite call, fsync and
    signature: it then waited up to a whole interval for the event loop to
    hand it back. Interleaved runs of the validator bench admitted about 5%
    more at 1 ms; at 0.5 ms the switching itself cost more than it saved.
    """
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def settle_heap() -> int:
    """Collect garbage once, then keep every object alive now out of later collections
    (``gc.freeze``); returns how many objects that is.

    A node holds its policy model and the libraries behind it: hundreds of thousands
    of long-lived objects. Every full collection would walk them all (about 0.2 s on a
    two-core machine), stalling admission that long every few hundred submissions.
    Objects made afterwards are collected as before, and a frozen object is still freed
    when its last reference goes; only a reference cycle among frozen objects is never
    collected. So call this once, when the node has loaded what it keeps for its life.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def server_config(app: FastAPI, host: str, port: int, log_level: str = "error") -> uvicorn.Config:
    """The uvicorn settings every node serves with.

    HTTP is parsed by httptools (llhttp, in C) and the event loop is uvloop's
    (libuv), where either is installed; uvicorn's pure-Python h11 parser and
    asyncio's loop took 0.39 ms of CPU per 70 KB submission against 0.15 ms for
    the pair, and the event loop shares the node's interpreter with admission.
    """
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http="httptools" if _installed("httptools") else "h11",
        loop="uvloop" if _installed("uvloop") else "asyncio",
    )


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen(host: str, port: int) -> socket.socket:
    """A socket bound and listening on ``host:port``, for ``serve_node``; ConfigError if the
    address is taken or cannot be bound.

    A node binds its port before it opens its ledger, so a second node started on the same
    port stops before it reads or writes any of its files."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
        sock.listen(2048)  # taken now: with SO_REUSEADDR, only a listening socket holds it
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}"
            + (
                " (another process, perhaps another node, has that port; set --port)"
                if exc.errno == errno.EADDRINUSE
                else ""
            )
        ) from None
    sock.set_inheritable(True)
    return sock


def wait_healthy(port: int, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Poll ``/healthz`` on 127.0.0.1:``port`` until it answers 200 (or ``proc`` exits)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the validator exited during start-up {out or ''}".rstrip())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the validator did not become healthy")


class BackgroundServer:
    """``with BackgroundServer(app) as url: ...`` serves ``app`` on 127.0.0.1."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(server_config(app, self.host, self.port))
        self.thread = threading.Thread(target=self.server.run, name="validator-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("validator service did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_node(
    cfg: ValidatorConfig,
    validator: Validator,
    *,
    summary_s: float = 30.0,
    sock: socket.socket | None = None,
) -> int:
    """Serve ``validator`` until SIGTERM or SIGINT, then stop cleanly; the process's exit code.

    ``sock``: the node's bound socket (``listen``); None binds ``cfg.node.host:port`` here.

    A clean stop: uvicorn stops accepting connections and lets requests in flight finish,
    the admission queue admits what it holds, and then a final checkpoint is signed, so every
    entry the node appended can be proven (``audit prove``) once it has stopped.
    """
    import uvicorn

    from node.validator.build import trainer_key
    from node.validator.service import create_app

    app = create_app(validator, trainer_key(cfg), summary_s=summary_s)
    settle_heap()  # the model and libraries stay loaded: keep full collections off them
    share_the_interpreter()
    server = uvicorn.Server(server_config(app, cfg.node.host, cfg.node.port, log_level="warning"))
    # uvicorn handles SIGTERM itself, then raises it again once it has shut down: with the
    # default handler that would end the process before the final checkpoint.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    port = cfg.node.port if sock is None else sock.getsockname()[1]
    print(f"listening on http://{cfg.node.host}:{port}", flush=True)
    try:
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:  # SIGINT, raised again by uvicorn after its shutdown
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        started = server.started
        final = _final_checkpoint(validator)
    if not started:  # the port was taken, or the app failed to start (uvicorn said why)
        print("the validator did not start")
        return 1
    print(f"stopped; final checkpoint covers all {final} entries", flush=True)
    return 0


def _final_checkpoint(validator: Validator) -> int:
    """Sign a checkpoint over the whole ledger, close it and the state store; the ledger size."""
    size = validator.ledger.checkpoint().checkpoint.size
    LOG.info("stopped: final checkpoint at size %d", size, extra={"event": "stop", "size": size})
    validator.ledger.close()
    validator.state.close()
    return int(size)
