"""bench/validator.py's load-generating client: reading HTTP/1.1 answers off a socket, and its
report to the bench."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import generate_latest

from bench.validator import _admission_counters, _Replies, _report
from node.validator.service import Metrics


def _pair_sending(chunks: list[bytes]) -> socket.socket:
    ours, theirs = socket.socketpair()

    def send() -> None:
        for chunk in chunks:
            theirs.sendall(chunk)
        theirs.close()

    threading.Thread(target=send, daemon=True).start()
    return ours


def test_answers_are_split_however_they_arrive() -> None:
    first = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\ncontent-length: 5\r\n\r\nhello"
    )
    second = b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 12\r\nretry-after: 1\r\n\r\n{"reason":1}'
    stream = first + second
    # byte by byte, then in odd pieces: each answer is its own status and body
    for pieces in (
        [stream[i : i + 1] for i in range(len(stream))],
        [stream[:7], stream[7:90], stream[90:]],
    ):
        replies = _Replies(_pair_sending(pieces))
        assert replies.next() == (200, b"hello")
        assert replies.next() == (429, b'{"reason":1}')


def test_an_answer_without_a_length_or_a_closed_connection_is_an_error() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    with pytest.raises(RuntimeError, match="without Content-Length"):
        _Replies(_pair_sending([chunked])).next()
    with pytest.raises(RuntimeError, match="closed the connection"):
        _Replies(_pair_sending([b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nhal"])).next()


def _client_printing(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_a_clients_report_is_read_while_it_waits_and_a_failure_says_why() -> None:
    # a client reports, then stays up until the bench lets it go
    waiting = _client_printing(
        'import sys; print(\'{"latencies": [0.5], "cpu_s": 0.25}\', flush=True); '
        'sys.stdin.read(); print("gone")'
    )
    assert _report(waiting) == {"latencies": [0.5], "cpu_s": 0.25}
    assert waiting.poll() is None
    assert waiting.communicate()[0] == "gone\n"
    failed = _client_printing("import sys; print(\"HTTP 400: b'bad_signature'\"); sys.exit(1)")
    with pytest.raises(RuntimeError, match="a client failed: HTTP 400: b'bad_signature'"):
        _report(failed)
    assert failed.returncode == 1


def test_the_admission_counters_are_read_from_the_nodes_own_metrics() -> None:
    metrics = Metrics()
    metrics.admitted_batch(3, 0.5, 0.2)
    metrics.admitted_batch(5, 0.25, 0.25)

    class Serve(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
            body = generate_latest(metrics.registry) if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        counted = _admission_counters(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert counted == {"busy": 0.75, "cpu": 0.45, "batches": 2.0, "groups": 8.0}
