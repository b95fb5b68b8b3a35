"""``Contributor(uploads=N)``: groups upload in the background while the next one generates.

Against a live validator on 127.0.0.1 over a tiny model: overlap really
happens and never exceeds N pending groups; every generated group is in the
state file before it is sent and is resubmitted (never regenerated) after a
crash, including the single-group state format of earlier versions; a refused
key raised on a submitter thread stops ``run``; the CLI refuses ``--uploads 0``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ledger.records import VerdictRecorded
from node.client import ServiceError, ValidatorClient
from node.contributor import Contributor
from node.validator.core import Validator
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from verify.errors import ConfigError, Reason
from verify.keys import SigningKey
from verify.types import SignedAssignment, SignedGroupVerdict

ALICE = SigningKey.from_seed(b"\x74" * 32)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def node(make_validator) -> Iterator[tuple[Validator, str]]:  # type: ignore[no-untyped-def]
    v = make_validator()
    with BackgroundServer(create_app(v)) as url:
        yield v, url


class LinkDown(Exception):
    """A simulated crash of the link, not a validator's answer."""


class Probe(ValidatorClient):
    """A real client that records its calls and can slow down or break ``submit``.

    ``on_submit(n, raw, answer)`` runs after the n-th submission (0-based) got
    its answer (``answer`` is None when ``send`` said not to send it). More than
    ``max_assigns`` assignments raise, so a loop that ignores a failure ends.
    The first ``overlap`` submissions each wait (up to a minute) until the state
    file holds another group besides their own, so generation and uploads
    overlap however fast or slow the machine generates.
    """

    def __init__(
        self,
        url: str,
        state_file: Path,
        *,
        delay_s: float = 0.0,
        send=lambda n: True,
        on_submit=None,  # type: ignore[no-untyped-def]
        max_assigns: int = 100,
        overlap: int = 0,
    ) -> None:
        super().__init__(url, ALICE)
        self.max_assigns, self.overlap = max_assigns, overlap
        self.state_file, self.delay_s, self.send, self.on_submit = (
            state_file,
            delay_s,
            send,
            on_submit,
        )
        self.lock = threading.Lock()
        self.uploading = 0
        self.assigns_while_uploading = 0
        self.assigns = 0
        self.pending_at_submit: list[int] = []
        self.pending_at_assign: list[int] = []
        self.answers: dict[bytes, SignedGroupVerdict] = {}
        self.submits = 0

    def _pending(self) -> int:
        if not self.state_file.exists():
            return 0
        state = json.loads(self.state_file.read_text())
        return (
            len(state["pending"]) if "pending" in state else int("group" in state)
        )  # or the old format

    def assign(self) -> SignedAssignment:
        with self.lock:
            self.assigns += 1
            if self.assigns > self.max_assigns:
                raise LinkDown(f"more than {self.max_assigns} assignments")
            self.assigns_while_uploading += self.uploading > 0
            self.pending_at_assign.append(self._pending())
        return super().assign()

    def submit(self, group):  # type: ignore[no-untyped-def,override]
        with self.lock:
            n = self.submits
            self.submits += 1
            self.uploading += 1
        try:
            deadline = time.monotonic() + 60
            while n < self.overlap and time.monotonic() < deadline:
                with self.lock:
                    if self._pending() >= 2:
                        break
                time.sleep(0.01)
            with self.lock:
                self.pending_at_submit.append(self._pending())
            time.sleep(self.delay_s)  # a slow wide-area link
            answer = super().submit(group) if self.send(n) else None
            if answer is not None:
                with self.lock:
                    self.answers.setdefault(group, answer)
            if self.on_submit is not None:
                self.on_submit(n, group, answer)
            if answer is None:
                raise LinkDown("the group was never sent")
            return answer
        finally:
            with self.lock:
                self.uploading -= 1


def _state(tmp: Path) -> Path:
    return tmp / "alice" / "contributor-state.json"


def _contributor(
    client: ValidatorClient, tmp: Path, tiny_model: Path, uploads: int, log: list[str] | None = None
) -> Contributor:
    sink = log if log is not None else []
    return Contributor(client, ALICE, tiny_model, tmp / "alice", uploads=uploads, log=sink.append)


def _upload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prooftrain-upload")]


def test_uploads_overlap_generation_and_all_groups_land(
    node, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    v, url = node
    client = Probe(url, _state(tmp_path), delay_s=0.4, overlap=4)
    client.register("alice")
    log: list[str] = []
    worker = _contributor(client, tmp_path, tiny_model, uploads=3, log=log)
    stats = worker.run(groups=5)

    assert stats.submitted == 5 and client.submits == 5 and client.assigns == 5
    assert stats.accepted == 5 * 4 and stats.rejected == 0
    assert [line.split(":")[0] for line in log] == [f"group {i}" for i in range(1, 6)]
    assert json.loads(_state(tmp_path).read_text())["pending"] == []
    assert not _upload_threads()  # drained
    # Generation went on while earlier groups were uploading ...
    assert client.assigns_while_uploading >= 2
    assert max(client.pending_at_submit) >= 2
    # ... but never past the bound: at most 2 pending when a third is taken.
    assert max(client.pending_at_assign) <= 2 and max(client.pending_at_submit) <= 3
    # Every group was in the state file before it was sent (counted at submit time).
    assert min(client.pending_at_submit) >= 1


def test_one_upload_waits_for_each_verdict(node, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    _, url = node
    client = Probe(url, _state(tmp_path), delay_s=0.2)
    client.register("alice")
    stats = _contributor(client, tmp_path, tiny_model, uploads=1).run(groups=3)
    assert stats.submitted == 3 and client.assigns_while_uploading == 0
    assert client.pending_at_submit == [1, 1, 1] and client.pending_at_assign == [0, 0, 0]


@pytest.mark.parametrize("uploads", [1, 2])
def test_a_stop_takes_no_new_assignment_and_answers_the_uploads_in_flight(
    node, tmp_path: Path, tiny_model: Path, uploads: int
) -> None:  # type: ignore[no-untyped-def]
    _, url = node
    worker: list[Contributor] = []

    def stop_after_first(n: int, raw: bytes, answer: object) -> None:
        if n == 0:
            worker[0].stop.set()  # what SIGTERM does in `prooftrain contributor`

    client = Probe(url, _state(tmp_path), on_submit=stop_after_first)
    client.register("alice")
    worker.append(_contributor(client, tmp_path, tiny_model, uploads=uploads))
    stats = worker[0].run()  # no group limit: only the stop ends it
    assert 1 <= stats.submitted <= uploads and client.assigns == stats.submitted
    assert stats.accepted == 4 * stats.submitted and worker[0].pending() == []
    assert not _upload_threads()


def test_sigterm_stops_the_contributor_process_cleanly(
    node, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    v, url = node
    key = tmp_path / "alice.key"
    subprocess.run(
        [sys.executable, "-m", "node.cli", "keys", "new", "--out", str(key)],
        check=True,
        capture_output=True,
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "contributor",
            "--validator",
            url,
            "--key",
            str(key),
            "--model",
            str(tiny_model),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(isinstance(rec, VerdictRecorded) for _, rec in v.ledger.entries()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM: stopping after the uploads in flight" in out and "Traceback" not in out
    assert "submitted " in out.splitlines()[-1]
    pending = json.loads((tmp_path / "state" / "contributor-state.json").read_text())["pending"]
    assert pending == []  # every generated group was answered before it stopped


def test_crash_leaves_groups_pending_and_restart_resubmits_them(
    node, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    v, url = node
    both_sent = threading.Barrier(2, timeout=60)

    def lose_ack(n: int, raw: bytes, answer: object) -> None:
        both_sent.wait()  # both groups reached the validator; then the link dies
        raise RuntimeError("connection lost before the acknowledgement")

    crashing = Probe(url, _state(tmp_path), on_submit=lose_ack, max_assigns=2)
    crashing.register("alice")
    with pytest.raises(RuntimeError, match="acknowledgement"):
        _contributor(crashing, tmp_path, tiny_model, uploads=3).run(groups=2)
    assert not _upload_threads()
    pending = json.loads(_state(tmp_path).read_text())["pending"]
    assert len(pending) == 2 and {bytes.fromhex(p["group"]) for p in pending} == set(
        crashing.answers
    )
    size = v.ledger.size()

    fresh = Probe(url, _state(tmp_path))
    worker = _contributor(fresh, tmp_path, tiny_model, uploads=2)
    stats = worker.run(groups=2)
    assert fresh.assigns == 0  # resubmitted, never regenerated
    assert stats.submitted == 2 and stats.accepted == 2 * 4
    assert fresh.answers == crashing.answers  # the stored verdicts, byte for byte
    assert v.ledger.size() == size  # nothing recorded twice
    assert worker.pending() == []


@pytest.mark.parametrize("uploads", [1, 2])
def test_old_single_group_state_is_resubmitted(
    node, tmp_path: Path, tiny_model: Path, uploads: int
) -> None:  # type: ignore[no-untyped-def]
    v, url = node
    offline = Probe(url, _state(tmp_path), send=lambda n: False)  # generated, never sent
    offline.register("alice")
    with pytest.raises(LinkDown):
        _contributor(offline, tmp_path, tiny_model, uploads=1).step()
    [entry] = json.loads(_state(tmp_path).read_text())["pending"]
    _state(tmp_path).write_text(
        json.dumps({"assignment": entry["assignment"], "group": entry["group"]})
    )
    size = v.ledger.size()

    client = Probe(url, _state(tmp_path))
    worker = _contributor(client, tmp_path, tiny_model, uploads=uploads)
    assert worker.pending() == [entry]
    stats = worker.run(groups=1)
    assert client.assigns == 0 and list(client.answers) == [bytes.fromhex(entry["group"])]
    assert stats.submitted == 1 and stats.accepted == 4
    assert v.ledger.size() > size  # answered now, for the first time
    assert json.loads(_state(tmp_path).read_text())["pending"] == []


@pytest.mark.parametrize("reason", [Reason.BANNED_KEY, Reason.UNKNOWN_KEY])
def test_refused_key_on_a_submitter_stops_run(
    node, tmp_path: Path, tiny_model: Path, reason: Reason
) -> None:  # type: ignore[no-untyped-def]
    _, url = node

    def refuse_second(n: int, raw: bytes, answer: object) -> None:
        if n == 1:
            raise ServiceError(403, reason.value, "contributor is banned")

    client = Probe(url, _state(tmp_path), delay_s=0.1, on_submit=refuse_second)
    client.register("alice")
    log: list[str] = []
    worker = _contributor(client, tmp_path, tiny_model, uploads=2, log=log)
    stats = worker.run(groups=8)  # returns, as a refused key does today: no exception

    assert any(line.startswith("stopping:") and reason.value in line for line in log)
    assert stats.reasons.get(reason.value) == 1
    assert client.assigns <= 4 and stats.submitted < 8  # stopped early
    assert stats.submitted == client.submits - 1  # every other upload was drained and counted
    assert not _upload_threads() and worker.pending() == []


def test_uploads_below_one_are_refused(node, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    _, url = node
    with pytest.raises(ConfigError, match="at least 1"):
        _contributor(ValidatorClient(url, ALICE), tmp_path, tiny_model, uploads=0)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "contributor",
            "--validator",
            url,
            "--key",
            str(tmp_path / "none.key"),
            "--model",
            str(tiny_model),
            "--uploads",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--uploads: must be at least 1" in result.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "node.cli", "contributor", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--uploads N" in help_text and "1 = one at a time" in " ".join(help_text.split())


def test_concurrent_state_updates_lose_nothing(node, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    _, url = node
    worker = _contributor(ValidatorClient(url, ALICE), tmp_path, tiny_model, uploads=4)
    entries = [
        [{"assignment": f"{t:02x}", "group": f"{t:02x}{i:02x}"} for i in range(15)]
        for t in range(4)
    ]

    def churn(mine: list[dict[str, str]]) -> None:
        for e in mine:
            worker._add_pending(e)
        for e in mine[::2]:
            worker._drop_pending(e["group"])

    threads = [threading.Thread(target=churn, args=(mine,)) for mine in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = worker.pending()
    assert sorted(e["group"] for e in left) == sorted(
        e["group"] for mine in entries for e in mine[1::2]
    )
    assert all(
        left.index(a) < left.index(b)
        for mine in entries
        for a, b in zip(mine[1::2], mine[3::2], strict=False)
    )


BUSY = {
    "backpressure": (429, Reason.BACKPRESSURE.value, "audit queue is full"),
    "disk full": (503, Reason.STORAGE_FULL.value, "the validator's disk is full"),
    "server error": (500, "", "Internal Server Error"),  # no reason code: still not final
}


@pytest.mark.parametrize("busy", sorted(BUSY))
@pytest.mark.parametrize("uploads", [1, 2])
def test_a_busy_validator_gets_the_group_again_not_a_drop(
    node,
    tmp_path: Path,
    tiny_model: Path,  # type: ignore[no-untyped-def]
    uploads: int,
    busy: str,
) -> None:
    v, url = node

    def busy_first(n: int, raw: bytes, answer: object) -> None:
        if n == 0:  # the group got in, but the answer came back as "busy"
            raise ServiceError(*BUSY[busy])

    client = Probe(url, _state(tmp_path), on_submit=busy_first, max_assigns=1)
    client.register("alice")
    log: list[str] = []
    size = v.ledger.size()
    stats = _contributor(client, tmp_path, tiny_model, uploads=uploads, log=log).run(
        groups=1, idle_s=0.01
    )

    assert client.assigns == 1 and client.submits == 2  # the same group, sent twice
    assert (
        stats.submitted == 1 and stats.accepted == 4 and stats.rejected == 0 and not stats.reasons
    )
    assert any(line.startswith("validator busy:") for line in log)
    assert v.ledger.size() > size and json.loads(_state(tmp_path).read_text())["pending"] == []
    recorded = [r for _, r in v.ledger.entries(size) if isinstance(r, VerdictRecorded)]
    assert len(recorded) == 4  # judged once


@pytest.mark.parametrize("uploads", [1, 2])
def test_an_unreachable_validator_is_tried_again_not_a_crash(
    node, tmp_path: Path, tiny_model: Path, uploads: int
) -> None:  # type: ignore[no-untyped-def]
    # The validator restarts while the first group's answer is on its way back: the link fails
    # past the client's own retries. The contributor sends the same group again after a pause
    # and goes on; it does not die with the group half-done.
    import httpx

    _, url = node

    def drop_first(n: int, raw: bytes, answer: object) -> None:
        if n == 0:
            raise httpx.ConnectError("[Errno 111] Connection refused")

    client = Probe(url, _state(tmp_path), on_submit=drop_first, max_assigns=1)
    client.register("alice")
    log: list[str] = []
    stats = _contributor(client, tmp_path, tiny_model, uploads=uploads, log=log).run(
        groups=1, idle_s=0.01
    )
    assert client.assigns == 1 and client.submits == 2  # the same group, sent again
    assert stats.submitted == 1 and stats.accepted == 4
    assert any(line.startswith("validator unreachable") for line in log)
    assert json.loads(_state(tmp_path).read_text())["pending"] == []


@pytest.mark.parametrize("failure", ["gone", "disk full"])
@pytest.mark.parametrize("uploads", [1, 2])
def test_a_stop_with_the_validator_gone_keeps_the_group_for_the_next_start(
    node, tmp_path: Path, tiny_model: Path, uploads: int, failure: str
) -> None:  # type: ignore[no-untyped-def]
    # `kill` reaches the validator and the contributor together (or the validator's disk is
    # full): the contributor's upload in flight can no longer be answered. It stops cleanly,
    # at once, with the group pending, and the next start sends it (the validator answers
    # with the verdicts it recorded, once).
    import httpx

    v, url = node
    worker: list[Contributor] = []

    def stop_and_lose_the_validator(n: int, raw: bytes, answer: object) -> None:
        worker[0].stop.set()  # what SIGTERM does in `prooftrain contributor`
        if failure == "disk full":
            raise ServiceError(*BUSY["disk full"])
        raise httpx.ConnectError("[Errno 111] Connection refused")

    client = Probe(
        url, _state(tmp_path), on_submit=stop_and_lose_the_validator, max_assigns=uploads
    )
    client.register("alice")
    log: list[str] = []
    worker.append(_contributor(client, tmp_path, tiny_model, uploads=uploads, log=log))
    stats = worker[0].run()  # no group limit: only the stop ends it
    kept = [bytes.fromhex(p["group"]) for p in worker[0].pending()]
    assert stats.submitted == 0 and 1 <= len(kept) == client.submits <= uploads
    assert set(kept) <= set(client.answers)  # each reached the validator; its answer was lost
    assert any("stays pending" in line for line in log)
    assert not _upload_threads()

    size = v.ledger.size()
    fresh = Probe(url, _state(tmp_path))
    again = _contributor(fresh, tmp_path, tiny_model, uploads=uploads).run(groups=len(kept))
    assert fresh.assigns == 0 and again.submitted == len(kept) and again.accepted == 4 * len(kept)
    assert v.ledger.size() == size  # judged once
