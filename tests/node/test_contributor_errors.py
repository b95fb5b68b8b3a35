"""Issue 48, finding 5: a contributor tells a final answer from a busy or absent validator.

A 4xx to a request for work ends it with one line naming the URL and the reason code; a
closed port is tried again from the very first request, one line per try naming the URL;
a wrong path is named with its status; a group from before a restart is said to be resent.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.cli import main
from node.client import ServiceError, ValidatorClient
from node.contributor import Contributor
from node.validator.core import Validator
from node.validator.server import BackgroundServer, free_port
from node.validator.service import create_app
from verify.keys import SigningKey, save_signing_key
from verify.types import SignedAssignment

ROOT = Path(__file__).resolve().parents[2]
BOB = SigningKey.from_seed(b"\x75" * 32)


@pytest.fixture
def node(make_validator) -> Iterator[tuple[Validator, str]]:  # type: ignore[no-untyped-def]
    v = make_validator()
    with BackgroundServer(create_app(v)) as url:
        yield v, url


class FinalAnswer(ValidatorClient):
    """A client whose first request for work gets a 400 (a corrupt blob on the validator);
    asking a second time fails the test."""

    asked = 0

    def assign(self) -> SignedAssignment:
        self.asked += 1
        if self.asked > 1:
            raise AssertionError("asked for work again after a final answer")
        raise ServiceError(
            400, "digest_mismatch", "blob does not match its digest", f"{self.url}/v1/blobs/ab"
        )

    @property
    def url(self) -> str:
        return str(self.http.base_url).rstrip("/")


def test_a_4xx_for_work_ends_the_contributor(node, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    _, url = node
    client = FinalAnswer(url, BOB)
    client.register("bob")
    log: list[str] = []
    worker = Contributor(client, BOB, tiny_model, tmp_path / "bob", log=log.append)
    with pytest.raises(ServiceError) as err:
        worker.run(groups=2, idle_s=0.01)
    assert str(err.value) == (
        f"{url}/v1/blobs/ab answered 400 [digest_mismatch]: blob does not match its digest"
    )
    assert client.asked == 1 and not any("busy" in line for line in log)


def test_a_wrong_path_names_the_url_and_the_status(
    node,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    tiny_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, url = node
    key = tmp_path / "bob.key"
    save_signing_key(BOB, key)
    args = ["contributor", "--validator", f"{url}/nope", "--key", str(key)]
    code = main([*args, "--model", str(tiny_model), "--state-dir", str(tmp_path / "s")])
    assert code == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: {url}/nope/v1/register answered 404: Not Found, without a reason code: "
        f"is {url}/nope a prooftrain validator's address?\n"
    )


def test_a_closed_port_is_tried_again_from_the_first_request(
    make_validator,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    tiny_model: Path,
) -> None:
    port = free_port()
    key = tmp_path / "bob.key"
    save_signing_key(BOB, key)
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "contributor", "--validator"]
        + [f"http://127.0.0.1:{port}", "--key", str(key), "--model", str(tiny_model)]
        + ["--state-dir", str(tmp_path / "s"), "--groups", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []

    def until(text: str) -> None:
        deadline = time.monotonic() + 120
        while not any(text in line for line in seen):
            assert proc.poll() is None or not lines.empty(), "".join(seen)
            assert time.monotonic() < deadline, "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass

    try:
        until("trying again")
        assert seen[-1] == (
            f"cannot reach the validator at http://127.0.0.1:{port}/v1/register: "
            "[Errno 111] Connection refused; trying again in 1 s\n"
        )
        with BackgroundServer(create_app(make_validator()), port=port):  # the node comes up
            until("registered as")
            assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert "Traceback" not in "".join(seen)


def test_a_group_from_before_a_restart_is_said_to_be_resent(
    node,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    tiny_model: Path,
) -> None:
    _, url = node
    client = ValidatorClient(url, BOB)
    client.register("bob")
    Contributor(client, BOB, tiny_model, tmp_path / "bob")._generate()  # then it stopped
    log: list[str] = []
    stats = Contributor(client, BOB, tiny_model, tmp_path / "bob", log=log.append).run(groups=1)
    assert stats.submitted == 1
    assert log[0].startswith("resending group ") and "(0 more pending)" in log[0]


def test_https_on_the_http_port_is_one_line_not_retried(
    node,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    tiny_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, url = node
    tls_url = url.replace("http://", "https://")
    key = tmp_path / "bob.key"
    save_signing_key(BOB, key)
    started = time.monotonic()
    code = main(
        ["contributor", "--validator", tls_url, "--key", str(key), "--model", str(tiny_model)]
        + ["--state-dir", str(tmp_path / "s")]
    )
    assert code == 1 and time.monotonic() - started < 5  # not the client's retries
    err = capsys.readouterr().err
    assert err.startswith(f"error: the TLS handshake with {tls_url}/v1/register failed (")
    assert err.count("\n") == 1
