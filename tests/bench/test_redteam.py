"""bench/redteam.py: a tiny run of every attack, honest controls untouched, every attack
group that differs from honest output rejected under full audit (but for the slack the
checks grant by design, which the bench measures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.adversaries.base import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
GRIND_GAIN_BOUND = 0.1
"""The most a grinder's kept mean reward may exceed its generated mean by
(threat_models/dishonest_contributor.md, grinding bound)."""
ALWAYS_DIFFERS = {  # attacks whose every group differs from honest output, and how each is caught
    "stop-overlong": "stopping_rule",
    "stop-empty": "stopping_rule",
    "stop-first-token": "stopping_rule",
    "planted-chunk1": "assignment_mismatch",
    "stale-version": "assignment_mismatch",
    "wrong-prompt": "wrong_prompt",
    "cherry-pick": "missing_group_member",
    "tampered-logprobs": "logprob_mismatch",
}


def test_quick_run_rejects_every_differing_attack_group_and_no_honest_one() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "redteam.py"), "--quick"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    check(json.loads(out.stdout.strip().splitlines()[-1]))


def check(result: dict) -> None:
    """What every run of the bench, of any size, must show."""
    assert result["bench"] == "redteam"

    honest = result["honest"]
    assert honest["groups"] > 0
    assert honest["false_rejections"] == 0, honest["reasons"]
    assert honest["slashes"] == 0 and honest["ledger_slashes"] == 0
    for name, control in honest["controls"].items():
        assert control["groups"] > 0, name
        assert control["false_rejections"] == 0 and control["slashes"] == 0, (name, control)
        assert control["ledger_slashes"] == 0, name

    attacks = result["attacks"]
    assert set(STRATEGIES) - set(result["skipped"]) <= set(attacks)
    # Slack the checks grant by design (the replay eps, a declared precision's bounds), measured.
    gaps = {name for name, r in attacks.items() if r.get("tolerated")}
    assert {"sub-replay-slack", "bf16-declared-replay-slack", "bf16-declared-noisy-policy"} <= gaps
    assert set(result["not_rejected_per_audit"]) <= gaps
    for name, r in attacks.items():
        audit = r["per_audit"]
        assert audit["submitted"] > 0, name
        if name not in gaps:
            assert audit["rejected_of_differing"] == audit["differing"], (name, audit)
        if audit["rejected_identical"]:  # honest output fails only the PIT test, at its alpha
            assert set(audit["reasons"]) == {"sampling_distribution"}, (name, audit)
        for mode in ("per_audit", "default_rate"):
            assert r[mode]["honest_slashed_in_ledger"] == 0, (name, mode)
            pit = r[mode].get("pit")  # a failed PIT window: recorded, and answered again as stored
            assert (
                pit is None or pit["failures"] == pit["in_ledger"] == pit["resubmission_stored"]
            ), pit
    for name, reason in ALWAYS_DIFFERS.items():
        audit = attacks[name]["per_audit"]
        assert audit["differing"] == audit["rejected"] == audit["submitted"], (name, audit)
        assert set(audit["reasons"]) == {reason}, (name, audit)

    grind = attacks["grind-k8"]["per_audit"]
    assert grind["rejected"] == 0  # honest output, selected: nothing to reject
    assert grind["assignments_obtained"] > 0
    if grind["max_outstanding"] < 8:  # the first round alone asks for more than the limit
        assert grind["assignment_limit_refusals"] >= 8 - grind["max_outstanding"]

    # Grinding by every discard method: at most max_outstanding assignments held per 2 ttl
    # beyond the groups it kept, and the kept groups' reward barely above what it generated.
    for method, g in result["grinding"].items():
        assert (
            g["assignments_per_key_per_2ttl"] <= g["max_outstanding"] + g["kept_groups_per_2ttl"]
        ), (method, g)
        assert g["kept_reward_gain"] is None or g["kept_reward_gain"] < GRIND_GAIN_BOUND, (
            method,
            g,
        )
        assert g["honest_slashed_in_ledger"] == 0 and not g["banned"], (method, g)
    assert set(result["grinding"]) == {
        "abandon",
        "missing_member",
        "unsupported_precision",
        "late",
        "stale",
    }
    # A refusal says nothing about the draw: drawn and undrawn submissions refused alike.
    leak = result["audit_draw_leak"]
    subs = leak["with_flood"]["submissions"]
    if min(subs.values()) >= 10:
        assert abs(leak["refused_drawn"] - leak["refused_undrawn"]) <= 0.25, leak
    assert leak["honest_slashed_in_ledger"] == 0
