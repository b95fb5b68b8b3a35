"""bench/trust_overhead.py: the summary it emits, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench import trust_overhead as bench

ROOT = Path(__file__).resolve().parents[2]


def _args(**kw: object) -> argparse.Namespace:
    base = dict(steps=4, groups=2, group_size=4, max_tokens=8, contributors=2, rounds=2, model_dir=None,
                pass_per_contributor=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _side(samples: int, wall_s: float, **extra: object) -> dict:
    return {"samples": samples, "wall_s": wall_s, **extra}


def test_summary_takes_each_sides_best_round_and_their_ratio() -> None:
    pts = [_side(32, 2.0, audit_rate_mean=0.5, audit_ok=True),
           _side(32, 1.0, audit_rate_mean=0.25, audit_ok=True)]
    trls = [_side(32, 0.5), _side(32, 0.8)]
    out = bench.summarise(_args(), pts, trls, None)
    assert out["prooftrain_samples_per_s"] == 32.0
    assert out["trl_samples_per_s"] == 64.0
    assert out["ratio"] == 0.5
    assert out["ratio_target"] == 0.7
    assert out["audit_rate_mean"] == 0.25  # from the round that counts
    assert out["batch_completions"] == 8
    assert out["prooftrain_rounds_samples_per_s"] == [16.0, 32.0]
    assert out["contributor_gradients"] == "one pass for all"
    assert "skipped" not in out
    fallback = bench.summarise(_args(pass_per_contributor=True), pts, trls, None)
    assert fallback["contributor_gradients"] == "a pass per contributor"


def test_summary_without_trl_is_null_and_says_why() -> None:
    pts = [_side(32, 1.0, audit_rate_mean=None, audit_ok=False)]
    out = bench.summarise(_args(rounds=1), pts, [], bench.TRL_MISSING)
    assert out["trl_samples_per_s"] is None and out["ratio"] is None
    assert out["skipped"] == bench.TRL_MISSING
    assert out["ledger_audit_ok"] is False


def test_reward_fn_is_the_validators_reward() -> None:
    got = bench.reward_fn(["47-85=", "1+2="], ["-38", "4"], problem_id=["a", "b"],
                          answer=["-38", "3"])
    assert got == [1.0, 0.0]


def test_tiny_run_prints_json_last() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "trust_overhead.py"), "--steps", "1",
           "--rounds", "1", "--groups", "2", "--group-size", "2", "--max-tokens", "2",
           "--contributors", "1", "--quiet"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "trust_overhead"
    assert result["prooftrain_samples_per_s"] > 0
    assert result["ledger_audit_ok"] is True
    if result["trl_samples_per_s"] is None:
        assert result["skipped"] == bench.TRL_MISSING
    else:
        assert result["ratio"] > 0
