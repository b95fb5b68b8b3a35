"""bench/contributor_grads.py: both per-contributor modes give the same update; a tiny run
times them and the plain-mean step and prints JSON last."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_compares_the_modes() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "contributor_grads.py"),
        "--contributors",
        "3",
        "--rows",
        "2",
        "--prompt",
        "4",
        "--completion",
        "3",
        "--rounds",
        "1",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "contributor_grads"
    assert sorted(result["by_contributors"], key=int) == ["2", "3", "6"]
    for row in result["by_contributors"].values():
        assert row["one_pass_ms"] > 0 and row["per_contributor_ms"] > 0 and row["plain_mean_ms"] > 0
        ratio = row["plain_mean_ms"] / row["one_pass_ms"]  # of the rounded times
        assert abs(row["trainer_trust_ratio"] - ratio) < 0.005
    assert result["speedup"] == result["by_contributors"]["3"]["speedup"]
    assert result["trainer_trust_ratio"] == result["by_contributors"]["3"]["trainer_trust_ratio"]
    assert "PlainStep" in result["baselines"]["plain_mean"]
    assert result["sketch_width"] == 64 and result["sketch_trainer_trust_ratio"] > 0
    assert result["keep_gib"] == 1.0
    assert all(row["one_pass_sketch_ms"] > 0 for row in result["by_contributors"].values())
    assert 0 <= result["max_update_diff"] < 1e-5
    assert result["freed_memory_kept"] is (platform.libc_ver()[0] == "glibc")
    for row in result["by_contributors"].values():
        assert all(row[f"{mode}_page_faults"] >= 0 for mode in ("one_pass", "plain_mean"))
