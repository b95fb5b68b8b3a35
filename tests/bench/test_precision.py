"""bench/precision.py --quick: honest streams stay quiet, gross attacks alarm, JSON on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_keeps_honest_streams_quiet_and_catches_gross_attacks() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "precision.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "precision" and result["quick"] is True
    assert result["honest_tokens"] > 4_000
    assert result["honest_alarms"] == 0 and result["honest_slashes"] == 0
    assert result["false_alarm_bound"] == 1e-6
    attacks = result["attacks"]
    assert {a.split("@")[0] for a in attacks} >= {
        "demo/int8",
        "demo/int4",
        "demo/skip-1-of-2-layers",
        "demo/weight-noise-1e-2",
        "demo/round-logprobs-0.01",
        "demo/temperature-0.95",
        "demo/temperature-1.05",
        "demo/top-k-50",
        "demo/steer-slack",
    }
    for name in (
        "demo/int4@calibrated",
        "demo/skip-1-of-2-layers@calibrated",
        "demo/steer-slack@calibrated",
    ):
        assert attacks[name]["detected"], name
        assert 0 < attacks[name]["tokens_to_detect_p95"] < 1_000, name
    honest = result["models"]["demo"]["honest"]["by_stream"]
    assert {k.split("@")[0] for k in honest} == {
        "float32/transformers",
        "bfloat16/transformers",
        "bfloat16/transformers-generate",
    }
    assert all(s["peak_log_wealth"] < s["threshold"] / 2 for s in honest.values())
