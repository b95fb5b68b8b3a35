"""bench/sampler.py: a tiny run prints its JSON line with every sampler, vocabulary and ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_measures_both_samplers_against_the_forward_pass() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sampler.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "sampler"
    assert set(result["samplers"]) == {"icdf-v1", "gumbel-v1"}
    for costs in result["samplers"].values():
        assert set(costs) == {"101", "49152", "151936"}
        assert all(c["contributor_ms"] > 0 and c["replay_ms"] > 0 for c in costs.values())
    forward, decode = result["forward_ms_per_token"], result["decode_ms_per_token"]
    assert forward["smollm2_135m_shape"] > forward["demo_policy"] > 0
    assert decode["smollm2_135m_shape"] > decode["demo_policy"] > 0
    # both vocabularies against both denominators, for both sides of both samplers
    for per_side in result["ratios"].values():
        for per_vocab in per_side.values():
            assert set(per_vocab) == {"101", "49152"}
            assert all(set(r) == {"forward", "decode"} for r in per_vocab.values())
    assert len(result["headline"]) == 8 and all(x > 0 for x in result["headline"].values())
    assert "decode" in result["baseline"] and "forward" in result["baseline"]
    # Gumbel-max hashes 8 bytes per vocabulary entry; inverse-CDF one word per token.
    big = result["samplers"]
    assert big["icdf-v1"]["151936"]["contributor_ms"] < big["gumbel-v1"]["151936"]["contributor_ms"]
    assert isinstance(result["target_met"], bool)
