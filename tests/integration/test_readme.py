"""Every command block of the README runs, in a tiny configuration, so the docs cannot rot.

Blocks run in order in a scratch directory holding a copy of ``configs/``;
``.venv/bin/prooftrain`` is this interpreter's ``-m node.cli``. What the
tiny configuration changes, and nothing else:

* the base model is the cached demo build copied into ``runs/base-model``
  (the build command then reports it cached instead of training again);
* the scenarios are replaced by a two-step, three-contributor scenario;
* the contributor talks to a validator this test starts on a free
  127.0.0.1 port, and placeholders (``CONTRIBUTOR_KEY_HEX``, ``VALIDATOR_KEY_HEX``)
  get the keys made by the earlier blocks;
* the quickstart (``make demo``, ``make test``) is what CI itself runs and is
  not run again from inside the suite;
* the campaigns run with short bounds (``--seconds 5``, fewer kills).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_SCENARIO = """
name = "{name}"
[task]
train_pool = 128
heldout = 16
[[population.groups]]
strategy = "honest"
count = 2
[[population.groups]]
strategy = "greedy"
count = 1
[validator]
group_size = 4
max_tokens = 8
[trainer]
steps = 2
batch_groups = 2
eval_every = 2
eval_problems = 16
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def readme_blocks() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        commands = body.replace("\\\n", " ").strip().splitlines()
        blocks.append([c.strip() for c in commands if c.strip() and not c.strip().startswith("#")])
    return blocks


def test_readme_blocks_are_found() -> None:
    blocks = readme_blocks()
    assert blocks[0] == ["make demo", "make test"]
    assert len(blocks) >= 6


def _prepare(work: Path) -> None:
    from trainer.base_model import ensure_base_model

    shutil.copytree(ROOT / "configs", work / "configs")
    for scenario in (work / "configs" / "scenarios").glob("*.toml"):
        scenario.write_text(TINY_SCENARIO.format(name=scenario.stem))
    shutil.copytree(ensure_base_model("arithmetic", progress=False), work / "runs" / "base-model")


SHORTER = {"--seconds 30": "--seconds 5", "--kills 5": "--kills 2", "--groups 5": "--groups 2"}


def _run(cmd: str, work: Path, subs: dict[str, str]) -> subprocess.CompletedProcess:
    if "harness." in cmd:
        for old, new in SHORTER.items():
            cmd = cmd.replace(old, new)
    for old, new in subs.items():
        cmd = cmd.replace(old, new)
    argv = shlex.split(cmd)
    if argv[0] == ".venv/bin/prooftrain":
        argv = [sys.executable, "-m", "node.cli", *argv[1:]]
    elif argv[0] == ".venv/bin/python":
        argv = [sys.executable, *argv[1:]]
    result = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    return result


def test_every_readme_block_runs(tmp_path: Path) -> None:
    from node.validator.server import free_port, wait_healthy
    from verify.keys import load_public_key

    work = tmp_path / "work"
    work.mkdir()
    _prepare(work)
    port = free_port()
    subs = {"http://127.0.0.1:8470": f"http://127.0.0.1:{port}"}
    server = None
    try:
        for block in readme_blocks()[1:]:
            for cmd in block:
                if cmd.startswith(".venv/bin/prooftrain contributor") and server is None:
                    pub = load_public_key(work / "keys" / "alice.key.pub")  # made by the block
                    server = subprocess.Popen(
                        [sys.executable, "-m", "node.cli", "validator", "--config",
                         "configs/validator.toml", "--port", str(port)],
                        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env=_env())
                    wait_healthy(port, server)
                    subs["CONTRIBUTOR_KEY_HEX"] = pub.hex()
                if "VALIDATOR_KEY_HEX" in cmd:
                    subs["VALIDATOR_KEY_HEX"] = load_public_key(work / "keys" / "validator.key.pub").hex()
                result = _run(cmd, work, subs)
                if cmd.startswith(".venv/bin/prooftrain contributor"):
                    assert "submitted 10 groups" in result.stdout
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    assert (work / "runs" / "demo" / "report.md").is_file()
    assert (work / "entry0.proof").is_file()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}
