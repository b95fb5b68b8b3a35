"""bench/trust_overhead.py: the summary it emits, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import trust_overhead as bench

ROOT = Path(__file__).resolve().parents[2]


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        steps=4,
        groups=2,
        group_size=4,
        max_tokens=8,
        contributors=2,
        rounds=2,
        model_dir=None,
        pass_per_contributor=False,
        task="reverse_text",
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _side(samples: int, wall_s: float, **extra: object) -> dict:
    return {"samples": samples, "wall_s": wall_s, **extra}


def test_summary_takes_each_sides_best_round_and_their_ratio() -> None:
    pts = [
        _side(32, 2.0, audit_rate_mean=0.5, audit_ok=True),
        _side(32, 1.0, audit_rate_mean=0.25, audit_ok=True),
    ]
    trls = [_side(32, 0.5), _side(32, 0.8)]
    out = bench.summarise(_args(), pts, trls, None)
    assert out["prooftrain_samples_per_s"] == 32.0
    assert out["trl_samples_per_s"] == 64.0
    assert out["ratio"] == 0.5
    assert out["ratio_target"] == 0.8
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
    got = bench.reward_fn(
        ["47-85=", "1+2="],
        ["-38", "4"],
        problem_id=["a", "b"],
        answer=["-38", "3"],
        task=["arithmetic"] * 2,
    )
    assert got == [1.0, 0.0]


def test_the_default_task_gives_partial_credit_inside_a_group() -> None:
    # The bench's task must give rewards that differ inside a group even for a model that
    # writes nothing like the answer, or every gradient is 0 and the trust layer's
    # aggregation is skipped on one side only.
    assert bench.TASK == "reverse_text"
    answers = ["abcdef"] * 4
    got = bench.reward_fn(
        ["reverse fedcba:"] * 4,
        ["abcdef", "abcxyz", "qqqqqf", "zzzzzz"],
        problem_id=list("abcd"),
        answer=answers,
        task=[bench.TASK] * 4,
    )
    assert got[0] == 1.0 and 0.0 < got[2] < got[1] < 1.0 and got[3] == 0.0


def test_tiny_run_prints_json_last() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "trust_overhead.py"),
        "--steps",
        "1",
        "--rounds",
        "1",
        "--groups",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "2",
        "--contributors",
        "1",
        "--task",
        "arithmetic",
        "--quiet",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "trust_overhead" and result["task"] == "arithmetic"
    assert result["prooftrain_samples_per_s"] > 0
    assert result["ledger_audit_ok"] is True
    if result["trl_samples_per_s"] is None:
        assert result["skipped"] == bench.TRL_MISSING
    else:
        assert result["ratio"] > 0
        assert result["trl_activation_checkpointing"] is False  # GRPOConfig's default is on


def test_phase_clock_charges_nested_calls_to_the_inner_phase() -> None:
    import time
    import types

    from bench._phases import PhaseClock, per_step

    box = types.SimpleNamespace()
    box.inner = lambda: time.sleep(0.02)
    box.outer = lambda: (time.sleep(0.01), box.inner())
    clock = PhaseClock()
    with clock.installed([("outer", box, "outer"), ("inner", box, "inner")]):
        box.outer()
    got = clock.snapshot()
    assert 0.02 <= got["inner"] < 0.2 and 0.01 <= got["outer"] < 0.02 + 0.05
    assert not hasattr(box.outer, "__wrapped__")  # restored
    steps = per_step({}, got, 1, wall_s=1.0)
    assert steps["other"] == pytest.approx(1.0 - got["inner"] - got["outer"], abs=1e-3)


def test_smollm2_dir_without_a_model_is_skipped_with_a_reason(tmp_path: Path) -> None:
    path, why = bench.smollm2_dir(str(tmp_path))
    assert path is None and why is not None and "smollm2-135m" in why


def test_tiny_scaling_run_prints_every_figure() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "trust_overhead.py"),
        "--scaling",
        "--sizes",
        "demo",
        "--scaling-steps",
        "1,1,1",
        "--scaling-rounds",
        "1,1,1",
        "--groups",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "2",
        "--contributors",
        "1",
        "--memory-params",
        "4096",
        "--task",
        "arithmetic",
        "--quiet",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mode"] == "scaling" and set(result["sizes"]) == {"demo"}
    demo = result["sizes"]["demo"]
    assert demo["params"] > 0 and demo["prooftrain_samples_per_s"] > 0
    phases = demo["prooftrain_phases_s"]
    assert {
        "generation",
        "signing",
        "admission_and_spot_checks",
        "rl_forward_backward",
        "per_contributor_gradients",
        "aggregation",
        "publication",
        "other",
    } <= set(phases)
    assert all(v >= 0 for v in phases.values()) and phases["generation"] > 0
    assert demo["prooftrain_peak_rss_mib"] > 0
    runs = result["aggregation_memory"]["runs"]
    assert [r["contributors"] for r in runs] == [4, 8]
    assert all(r["params"] == 4096 and r["finite"] for r in runs)
    if demo["ratio"] is None:
        assert result["skipped"] == bench.TRL_MISSING
    else:
        assert demo["ratio"] > 0 and demo["trl_peak_rss_mib"] > 0
        assert result["ratios"] == {"demo": demo["ratio"]}


@pytest.mark.parametrize(
    "template", [None, "{% for m in messages %}[{{ m['content'] }}]{% endfor %}>"]
)
def test_trl_gets_the_prompt_tokens_prooftrains_nodes_encode(template: str | None) -> None:
    """With a chat template TRL renders the prompt through it (``_tokenize_prompts``) as the
    nodes do; without one both sides tokenise the text. A side that skipped the template would
    train on sequences several times shorter (SmolLM2: 6 prompt tokens against 36)."""
    from transformers import AutoTokenizer

    from rollout.prompting import encode_prompt
    from trainer.base_model import ensure_base_model

    tok = AutoTokenizer.from_pretrained(ensure_base_model("arithmetic"))
    tok.chat_template = template
    text = "85-92="
    prompt = bench.trl_prompt(text, tok)
    if template is None:
        assert prompt == text
        trl_ids = tok(text=[prompt])["input_ids"][0]
    else:
        assert prompt == [{"role": "user", "content": text}]
        trl_ids = tok.apply_chat_template(
            conversation=[prompt], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        assert len(trl_ids) > len(tok(text)["input_ids"])  # the template's tokens are there
    assert list(trl_ids) == encode_prompt(tok, text)
    completion = [{"role": "assistant", "content": "-7"}]
    assert bench.reward_fn([prompt], [completion], ["p"], ["-7"], ["arithmetic"]) == [1.0]
