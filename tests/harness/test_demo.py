"""``make demo`` end to end in miniature: scenario, report, evals in the ledger, verified release."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.demo import run_demo
from ledger.log import Ledger
from ledger.records import EvalRecorded, PolicyPublished

SCENARIO = """
name = "mini-demo"
seed = 1
[task]
train_pool = 256
heldout = 32
[[population.groups]]
strategy = "honest"
count = 2
network = "lan"
[[population.groups]]
strategy = "gradient-inflation"
count = 1
network = "lan"
[network.profiles.lan]
latency = { model = "lognormal", params = { median_ms = 10, sigma = 0.2 } }
[validator]
group_size = 4
max_tokens = 6
[trainer]
steps = 3
batch_groups = 1
eval_every = 3
eval_problems = 16
eval_every_version = true
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def test_demo_ends_with_a_verified_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    from ledger.release import verify_release
    from verify.keys import load_public_key

    torch.set_num_threads(1)
    scenario = tmp_path / "mini.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "demo"
    assert run_demo(out, scenario) == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.md'}" in printed
    assert f"release: {out / 'release'} (verified" in printed

    ledger = Ledger.open(out / "runs" / "scenario" / "ledger.sqlite")
    records = [r for _, r in ledger.entries()]
    ledger.close()
    assert [r.version for r in records if isinstance(r, PolicyPublished)] == [1, 2, 3]
    assert [r.version for r in records if isinstance(r, EvalRecorded)] == [0, 1, 2, 3]

    report = verify_release(
        out / "release",
        trainer_key=load_public_key(str(out / "keys" / "trainer.pub")),
        validator_key=load_public_key(str(out / "keys" / "validator.pub")),
    )
    assert report is not None
    released = AutoModelForCausalLM.from_pretrained(out / "release")
    assert sum(p.numel() for p in released.parameters()) > 0
    assert "pass@1" in (out / "release" / "README.md").read_text()
