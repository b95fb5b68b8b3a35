"""Issue 48, finding 7: ``--check`` refuses a path the node could not write, in one line.

Root passes every permission check, so as root each check runs in a child process under
the ``nobody`` account, in a directory that account can enter.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from node.config import ValidatorConfig
from node.validator.check import describe
from verify.errors import ConfigError
from verify.keys import SigningKey

KEY = SigningKey.from_seed(b"\x31" * 32)


def _unprivileged(check: Callable[[], object]) -> str:
    """The ConfigError ``check`` raises ("" if none), run without root's privileges."""
    if os.geteuid() != 0:
        try:
            check()
        except ConfigError as exc:
            return str(exc)
        return ""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root without a 'nobody' account to drop to")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, run the check, report, and exit at once
        os.close(read)
        message = ""
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            check()
        except ConfigError as exc:
            message = str(exc)
        except BaseException as exc:  # noqa: BLE001  (reported to the parent, which fails)
            message = f"unexpected {exc!r}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A directory every account may enter and write (``tmp_path`` is private to root)."""
    root = Path(tempfile.mkdtemp(prefix="prooftrain-paths-"))
    root.chmod(0o777)
    (root / "model").mkdir(mode=0o755)
    (root / "model" / "config.json").write_text("{}")
    (root / "model" / "config.json").chmod(0o644)
    yield root
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(root)


def _config(root: Path, **node: object) -> ValidatorConfig:
    return ValidatorConfig.model_validate(
        {
            "node": {"ledger": str(root / "run" / "ledger.sqlite"), **node},
            "policy": {"model_dir": str(root / "model")},
            "task": {"pool": 8},
        }
    )


def _directory(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def test_writable_paths_pass(node_root: Path) -> None:
    _directory(node_root / "run", 0o777)
    assert _unprivileged(lambda: describe(_config(node_root), KEY)) == ""


def test_an_unwritable_blob_directory_is_refused(node_root: Path) -> None:
    _directory(node_root / "run", 0o777)
    blobs = _directory(node_root / "run" / "ledger.sqlite.blobs", 0o555)
    message = _unprivileged(lambda: describe(_config(node_root), KEY))
    assert message == (
        f"blob store {blobs} is not writable by this user: fix its permissions, or set "
        "node.blob_dir"
    )


def test_an_unwritable_ledger_directory_is_refused(node_root: Path) -> None:
    _directory(node_root / "run", 0o555)
    message = _unprivileged(lambda: describe(_config(node_root), KEY))
    assert message.startswith(f"ledger {node_root / 'run' / 'ledger.sqlite'} (under ")
    assert "is not writable by this user" in message and "\n" not in message


def test_an_unwritable_state_file_is_refused(node_root: Path) -> None:
    _directory(node_root / "run", 0o777)
    state = node_root / "run" / "node.state"
    state.write_bytes(b"")
    state.chmod(0o444)
    message = _unprivileged(lambda: describe(_config(node_root, state_file=str(state)), KEY))
    assert message.startswith(f"state file {state} is not writable by this user")
