"""A client with ``wait_out`` rides out a validator that cannot answer for a while (restart,
busy, full disk) by sending the same request again; every other error is raised at once."""

from __future__ import annotations

import httpx
import pytest

from node.client import (
    MAX_RETRY_AFTER_S,
    UNREACHABLE_WAIT_S,
    ServiceError,
    ValidatorClient,
    ValidatorUnreachable,
    waited_out,
)
from node.remote_trainer import waiting_out
from verify.errors import ProofTrainError, Reason
from verify.keys import SigningKey

KEY = SigningKey.from_seed(b"\x31" * 32)
FULL = {"reason": "storage_full", "message": "the validator's disk is full: nothing was recorded"}


class Script:
    """A mock validator answering from a list: an int status (with ``FULL`` or a conflict
    body), ``(503, retry_after)`` (a 503 with that Retry-After, or none for None), ``"down"``
    (a refused connection) or ``"ok"``; it records every request."""

    def __init__(self, *answers: int | str) -> None:
        self.answers, self.seen = list(answers), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.content))
        answer = self.answers.pop(0)
        if answer == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if answer == "ok":
            return httpx.Response(200, json={"digest": "ab" * 32})
        if isinstance(answer, tuple):
            status, after = answer
            headers = {} if after is None else {"retry-after": after}
            return httpx.Response(status, json=FULL, headers=headers)
        if answer == 503:
            return httpx.Response(503, json=FULL, headers={"retry-after": "30"})
        if answer == 429:
            return httpx.Response(429, json={"reason": "backpressure", "message": "busy"})
        return httpx.Response(answer, json={"reason": "conflict", "message": "no"})


def _client(script: Script, waits: list, go_on: bool = True, retries: int = 0):  # type: ignore[no-untyped-def]
    def wait(problem: ProofTrainError, seconds: float) -> bool:
        waits.append((problem, seconds))
        return go_on

    return ValidatorClient(
        "http://validator.test",
        KEY,
        retries=retries,
        backoff=0.0,
        wait_out=wait,
        transport=httpx.MockTransport(script),
    )


def test_a_full_disk_is_waited_out_and_the_same_request_sent_again() -> None:
    script, waits = Script(503, 503, "ok"), []
    digest = _client(script, waits).put_blob(b"blob bytes")
    assert digest == bytes.fromhex("ab" * 32)
    assert [s[2] for s in script.seen] == [b"blob bytes"] * 3  # the same body every time
    assert [(type(p), p.reason, s) for p, s in waits] == [
        (ServiceError, Reason.STORAGE_FULL, 30.0)
    ] * 2


def test_a_restarting_validator_is_waited_out_after_the_retries() -> None:
    script, waits = Script("down", "down", "down", "ok"), []
    assert _client(script, waits, retries=1).put_blob(b"x") == bytes.fromhex("ab" * 32)
    assert len(script.seen) == 4
    assert [(type(p), s) for p, s in waits] == [(ValidatorUnreachable, UNREACHABLE_WAIT_S)]
    assert "http://validator.test/v1/blobs" in str(waits[0][0])


def test_busy_is_waited_out_once_the_retries_are_spent() -> None:
    script, waits = Script(429, 429, "ok"), []
    assert _client(script, waits, retries=1).put_blob(b"x") == bytes.fromhex("ab" * 32)
    assert len(script.seen) == 3 and len(waits) == 1
    assert waits[0][0].reason is Reason.BACKPRESSURE


def test_a_final_answer_is_raised_at_once_and_giving_up_raises_the_wait() -> None:
    script, waits = Script(409), []
    with pytest.raises(ServiceError) as final:
        _client(script, waits).put_blob(b"x")
    assert final.value.status == 409 and waits == [] and len(script.seen) == 1

    script, waits = Script(503), []
    with pytest.raises(ServiceError) as full:
        _client(script, waits, go_on=False).put_blob(b"x")
    assert full.value.reason is Reason.STORAGE_FULL and len(waits) == 1

    script = Script(503)  # no wait_out: the refusal is the caller's, at once, as before
    plain = ValidatorClient(
        "http://validator.test", KEY, retries=3, transport=httpx.MockTransport(script)
    )
    with pytest.raises(ServiceError):
        plain.put_blob(b"x")
    assert len(script.seen) == 1


def test_the_trainer_says_what_it_waits_for_once_a_minute_and_stops_on_request() -> None:
    lines: list[str] = []
    stopped = [False]
    wait = waiting_out(lambda: stopped[0], patience_s=0.01, log=lines.append, every_s=60.0)
    full = ServiceError(503, "storage_full", "the validator's disk is full", "http://v/v1/blobs")
    assert wait(full, 30.0) and wait(full, 30.0)  # capped at patience_s: returns at once
    assert len(lines) == 1
    assert "free space on the validator's disk" in lines[0] and "node.blob_dir" in lines[0]
    assert "every 0.01 s" in lines[0] and "SIGTERM ends the wait" in lines[0]

    gone = ValidatorUnreachable("http://v/v1/info", httpx.ConnectError("refused"))
    other = waiting_out(lambda: stopped[0], patience_s=0.01, log=lines.append)
    assert other(gone, UNREACHABLE_WAIT_S)
    assert "is the validator running, and reachable from here, at that address?" in lines[-1]
    stopped[0] = True
    assert not wait(full, 30.0) and not other(gone, 5.0)


def test_without_wait_out_the_client_behaves_as_it_did() -> None:
    """Busy is retried ``retries`` times, then raised; unreachable is retried, then raised."""
    script = Script(429, 429, 429)
    plain = ValidatorClient(
        "http://v.test", KEY, retries=2, backoff=0.0, transport=httpx.MockTransport(script)
    )
    with pytest.raises(ServiceError) as busy:
        plain.put_blob(b"x")
    assert busy.value.status == 429 and len(script.seen) == 3

    script = Script("down", "down", "down")
    plain = ValidatorClient(
        "http://v.test", KEY, retries=2, backoff=0.0, transport=httpx.MockTransport(script)
    )
    with pytest.raises(ValidatorUnreachable):
        plain.put_blob(b"x")
    assert len(script.seen) == 3


@pytest.mark.parametrize(
    ("after", "asked"),
    [
        ("30", 30.0),
        (None, UNREACHABLE_WAIT_S),  # no Retry-After: a proxy's 503
        ("Wed, 21 Oct 2026 07:28:00 GMT", UNREACHABLE_WAIT_S),  # a date is not read
        ("inf", MAX_RETRY_AFTER_S),
        ("nan", UNREACHABLE_WAIT_S),
        ("-5", UNREACHABLE_WAIT_S),
    ],
)
def test_the_wait_asked_for_is_read_from_retry_after(after: str | None, asked: float) -> None:
    script, waits = Script((503, after), "ok"), []
    _client(script, waits).put_blob(b"x")
    assert [s for _, s in waits] == [asked]


def test_only_what_is_waited_out_counts_as_a_wait_a_stop_ended() -> None:
    assert waited_out(ValidatorUnreachable("http://v", httpx.ConnectError("refused")))
    assert waited_out(ServiceError(503, "storage_full", "full"))
    assert waited_out(ServiceError(429, "backpressure", "busy"))
    assert not waited_out(ServiceError(409, "conflict", "no"))  # a final answer
    assert not waited_out(ServiceError(404, "not_found", "no blob"))


def test_a_wait_is_capped_stops_at_once_and_says_so_again_when_the_problem_changes() -> None:
    import threading
    import time

    lines: list[str] = []
    stop = threading.Event()
    wait = waiting_out(stop.is_set, patience_s=0.05, log=lines.append, every_s=60.0)
    full = ServiceError(503, "storage_full", "the validator's disk is full")
    began = time.monotonic()
    assert wait(full, 30.0)  # the validator asked for 30 s: patience_s caps it
    assert time.monotonic() - began < 1.0
    gone = ValidatorUnreachable("http://v/v1/blobs", httpx.ConnectError("refused"))
    assert wait(gone, UNREACHABLE_WAIT_S) and wait(gone, UNREACHABLE_WAIT_S)
    assert len(lines) == 2  # the problem changed within the minute: told again, then not
    assert "free space" in lines[0] and "reachable from here" in lines[1]

    slow = waiting_out(stop.is_set, patience_s=30.0, log=lines.append)
    threading.Timer(0.2, stop.set).start()
    began = time.monotonic()
    assert not slow(full, 30.0)  # SIGTERM mid-wait: given up within half a second
    assert time.monotonic() - began < 2.0
