"""bench/trust_overhead.py: the summary it emits, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import trust_overhead as bench

ROOT = Path(__file__).resolve().parents[2]
LOAD = ("before", "after")


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        steps=4,
        warmup_steps=1,
        baseline_warmup_steps=1,
        groups=2,
        group_size=4,
        max_tokens=8,
        contributors=2,
        rounds=2,
        model_dir=None,
        pass_per_contributor=False,
        gram_sketch=0,
        keep_gib=1.0,
        task="reverse_text",
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _side(samples: int, wall_s: float, **extra: object) -> dict:
    return {
        "samples": samples,
        "wall_s": wall_s,
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [1.5, 1.0, 1.0],
        **extra,
    }


def test_in_turns_the_trust_ratio_is_the_median_of_the_paired_rounds() -> None:
    """Where the sides took turns, each round compares them under the same load, so the
    rounds' ratios count, not each side's best round: here trust on's best round (round 3)
    and trust off's (round 1) ran under different loads, and pairing them gives 0.6 where
    the rounds' median is 0.8."""
    ons = [
        _side(30, 1.0, audit_ok=True),
        _side(24, 1.0, audit_ok=True),
        _side(36, 1.0, audit_ok=True),
    ]
    offs = [_side(60, 1.0), _side(30, 1.0), _side(45, 1.0)]
    out = bench.summarise(_args(interleave=True), ons, offs, [], [], None)
    assert [r["trust_ratio"] for r in out["trust_rounds"]] == [0.5, 0.8, 0.8]
    assert out["trust_ratio"] == 0.8 == out["trust_ratio_median_of_rounds"]
    assert out["trust_ratio_rule"] == bench.PAIRED_RULE and out["interleaved"] is True
    assert out["trust_ratio_best_of_sides"] == 0.6  # 36 / 60


def test_summary_takes_the_trust_ratio_from_the_two_sides_and_names_its_baselines() -> None:
    ons = [
        _side(32, 2.0, audit_rate_mean=0.5, audit_ok=True),
        _side(32, 1.0, audit_rate_mean=0.25, audited_share=0.125, audit_ok=True),
    ]
    offs = [_side(32, 0.8), _side(32, 0.5)]
    trls = [_side(32, 0.5), _side(32, 0.8)]
    unshared = [_side(32, 4.0, audit_ok=True, phases_s={"generation": 0.3})]
    args = _args(order=["trust_on", "trust_off"])
    out = bench.summarise(args, ons, offs, trls, unshared, None)
    assert out["trust_on_samples_per_s"] == 32.0 and out["trust_off_samples_per_s"] == 64.0
    assert out["trust_ratio"] == 0.5  # in sequence, the best round of each side: 32 / 64
    assert out["trust_ratio_rule"] == bench.SEQUENCE_RULE
    assert [r["trust_ratio"] for r in out["trust_rounds"]] == [0.4, 0.5]  # 16/40, 32/64
    assert out["trust_ratio_median_of_rounds"] == 0.45
    assert out["trust_ratio_best_of_sides"] == 0.5
    assert [r["first"] for r in out["trust_rounds"]] == ["trust_on", "trust_off"]
    assert out["order_balanced"] is True
    assert out["trust_rounds"][0]["trust_on_load"] == {
        "before": [1.0, 1.0, 1.0],
        "after": [1.5, 1.0, 1.0],
    }
    assert out["trust_ratio_baseline"] == bench.TRUST_BASELINE
    assert out["audit_rate_mean"] == 0.25  # from the round that counts
    assert out["audited_share"] == 0.125 and out["warmup_steps"] == 1
    assert out["trl_samples_per_s"] == 64.0 and out["unshared_samples_per_s"] == 8.0
    assert out["trl_ratio"] == 0.125 and out["trl_ratio_baseline"] == bench.TRL_BASELINE
    assert out["unshared_generation_s_per_step"] == 0.3
    assert out["batch_completions"] == 8
    assert out["contributor_gradients"] == "one pass for all" and out["gram_sketch"] == 0
    assert "skipped" not in out
    fallback = bench.summarise(_args(pass_per_contributor=True), ons, offs, [], [], None)
    assert fallback["contributor_gradients"] == "a pass per contributor"
    assert bench.summarise(_args(gram_sketch=32), ons, offs, [], [], None)["gram_sketch"] == 32
    assert fallback["trl_ratio"] is None


def test_summary_without_trl_is_null_and_says_why() -> None:
    ons = [_side(32, 1.0, audit_rate_mean=None, audit_ok=False)]
    out = bench.summarise(_args(rounds=1), ons, [_side(32, 1.0)], [], [], bench.TRL_MISSING)
    assert out["trl_samples_per_s"] is None and out["trl_ratio"] is None
    assert out["trust_ratio"] == 1.0
    assert out["skipped"] == bench.TRL_MISSING
    assert out["order_balanced"] is False  # one round: trust on went first, trust off never
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
        "--warmup-steps",
        "2",
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
        "--no-interleave",  # one side after the other (the default takes turns: next test)
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "trust_overhead" and result["task"] == "arithmetic"
    assert result["interleaved"] is False and result["interleave_skipped"] == "--no-interleave"
    on, off = result["trust_on_samples_per_s"], result["trust_off_samples_per_s"]
    assert on > 0 and off > 0
    assert result["trust_ratio"] == pytest.approx(on / off, abs=0.01)
    (only,) = result["trust_rounds"]
    assert only["trust_ratio"] == result["trust_ratio"]
    assert all(len(only[f"trust_{s}_load"][w]) == 3 for s in ("on", "off") for w in LOAD)
    assert result["ledger_audit_ok"] is True
    # The trust-on side signs, verifies, admits, records, aggregates and publishes...
    calls = result["trust_on_calls"]
    assert {k for k, n in calls.items() if n > 0} == {name for name, _, _ in bench.TRUST_CALLS}
    assert result["warmup_steps"] == 2 and result["baseline_warmup_steps"] == 1
    assert result["trust_on_verdicts"] == 3 * 2  # 3 steps of 2 groups, every one judged
    # A new key is on probation: every completion audited.
    assert result["audited_share"] == 1.0 and result["audit_rate_timed"] == 1.0
    assert result["audited_completions_timed"] == 1.0
    for side in ("on", "off"):  # both sides' batches: 2 groups x 2 rows of prompt + 2 tokens
        padded, real = (
            result[f"trust_{side}_tokens_per_step"],
            result[f"trust_{side}_real_tokens_per_step"],
        )
        assert padded % 4 == 0 and 4 * 3 <= real <= padded
    # ... the trust-off side none of it: one plain pass and step per step, its own groups
    # (one warm-up step: it has no contributors on probation).
    assert result["trust_off_calls"] == {}
    assert result["trust_off_counts"] == {"groups": 4, "samples": 8, "steps": 2, "passes": 2}
    assert {"generation", "rl_forward_backward", "optimizer_step"} <= set(
        result["trust_off_phases_s"]
    )
    if result["trl_samples_per_s"] is None:
        assert result["skipped"] == bench.TRL_MISSING
    else:
        assert result["trl_ratio"] > 0
        assert result["trl_activation_checkpointing"] is False  # GRPOConfig's default is on
        assert result["trl_generation_s_per_step"] > 0


def test_step_intervals_show_whether_the_sides_took_turns() -> None:
    on = [[0.0, 1.0], [2.0, 3.0], [5.0, 6.0]]
    off = [[1.0, 2.0], [4.0, 5.0], [3.0, 4.0]]  # pairs: (on, off), (on, off), (off, on)
    assert bench.overlaps(on, off) == 0 and bench.alternated(on, off)
    late = [[1.5, 2.5], [4.0, 5.0], [3.0, 4.0]]  # the first overlaps an on step
    assert bench.overlaps(on, late) == 1
    together = [[6.0, 7.0], [7.0, 8.0], [8.0, 9.0]]  # all of off after all of on
    assert bench.overlaps(on, together) == 0 and not bench.alternated(on, together)
    assert not bench.alternated(on, off[:2]) and not bench.alternated([], [])


def test_an_interleaved_run_takes_turns_step_by_step() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "trust_overhead.py")]  # turns by default
    cmd += ["--steps", "3", "--warmup-steps", "2", "--rounds", "2", "--groups", "2"]
    cmd += ["--group-size", "2", "--max-tokens", "2", "--contributors", "1"]
    cmd += ["--task", "arithmetic", "--quiet"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["interleaved"] is True and result["interleave_skipped"] is None
    assert result["order_balanced"] is True
    assert [r["first"] for r in result["trust_rounds"]] == ["trust_on", "trust_off"]
    for r in result["trust_rounds"]:
        # both processes were up at once, yet no two timed steps ran together
        assert r["overlapping_steps"] == 0 and r["steps_alternated"] is True, r
        # each side's process kept to about one core while its steps ran
        assert 0 < r["trust_on_cpu_per_wall"] <= 1.5 and 0 < r["trust_off_cpu_per_wall"] <= 1.5
        assert r["trust_ratio"] == pytest.approx(
            r["trust_on_samples_per_s"] / r["trust_off_samples_per_s"], abs=0.01
        )
    assert result["ledger_audit_ok"] is True


def test_sides_that_do_not_fit_in_memory_together_run_one_after_the_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bench, "available_bytes", lambda: 22 * 2**30)  # a 24 GB machine
    monkeypatch.setattr(bench, "model_params", lambda _: 134_515_008)  # SmolLM2-135M
    args = _args(model_dir=str(tmp_path), contributors=8)
    why = bench.interleave_refusal(args)
    # measured there: 19238 + 7754 MiB peak resident; the estimate must not fall below that
    assert why is not None and "134.5M parameters" in why and "22.0 GiB is available" in why
    need = float(why.split("about ")[1].split(" GiB")[0])
    assert (19238 + 7754) / 1024 <= need <= 40
    monkeypatch.setattr(bench, "model_params", lambda _: 14_199_552)  # the 14M Llama
    assert bench.interleave_refusal(args) is None  # 2514 + 1217 MiB measured
    monkeypatch.setattr(bench, "available_bytes", lambda: 4 * 2**30)
    assert bench.interleave_refusal(args) is not None
    assert bench.interleave_refusal(_args(model_dir=None, contributors=8)) is None  # demo


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


def test_the_steady_warm_up_takes_every_contributor_off_probation() -> None:
    from ledger.reputation import PROBATION_ROLLOUTS

    # 8 groups of 8 a step over 8 contributors: 8 audited completions per key per step.
    assert bench.steady_warmup(8, 8, 8) == 1 + PROBATION_ROLLOUTS // 8
    assert bench.steady_warmup(8, 16, 8) == 1 + PROBATION_ROLLOUTS // 16
    assert bench.steady_warmup(3, 2, 5) == 1 + math.ceil(PROBATION_ROLLOUTS * 3 / 10)


def test_the_default_kept_rows_budget_holds_every_contributors_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bench, "model_params", lambda _: 134_515_008)  # SmolLM2-135M
    # 8 x 134.5M float32 rows are 4.01 GiB: 5 whole GiB, plus 1.
    assert bench.rows_gib(_args(model_dir=str(tmp_path), contributors=8)) == 6.0
    assert bench.rows_gib(_args(model_dir=str(tmp_path), contributors=4)) == 4.0
    assert bench.rows_gib(_args(model_dir=None)) == 1.0  # the demo model: the trainer's


def test_the_validator_keeps_a_deployments_assignment_ttl(tmp_path: Path) -> None:
    """A 135M step takes about 30 s: the harness's 30 s TTL would expire the assignments
    honest contributors fetched ahead and count them as abandoned."""
    args = argparse.Namespace(
        task="reverse_text", contributors=2, group_size=2, max_tokens=2, steps=1,
        warmup_steps=1, groups=1, lr=1e-4, gram_sketch=0, keep_gib=1.0, model_dir=None,
    )  # fmt: skip
    scenario = bench.write_scenario(args, tmp_path)
    assert scenario.validator.assignment_ttl_s == bench.ASSIGNMENT_TTL_S == 600.0


def test_the_audit_rate_is_read_per_completion_from_the_ledger(tmp_path: Path) -> None:
    """The rate each completion's draw applied and whether it was audited, after the warm-up's
    last version; an assignment's own draw and a member recorded at rate 0 are no completion
    drawn for."""
    from ledger.log import Ledger
    from ledger.records import DrawnVerdict, PolicyPublished
    from verify.keys import SigningKey

    key = SigningKey.from_seed(b"\x44" * 32)

    def drawn(rate: float, audited: bool, completion: bytes = b"\x09" * 32) -> DrawnVerdict:
        return DrawnVerdict(
            b"\x01" * 32, b"\x02" * 16, 0, b"\x03" * 32, True, "", audited, b"", 0,
            completion, rate, False,
        )  # fmt: skip

    def published(version: int) -> PolicyPublished:
        return PolicyPublished(version, b"", bytes([version]) * 32, key.public.raw, 0)

    ledger = Ledger.open(tmp_path / "l.sqlite", signing_key=key, origin="test/bench")
    ledger.append_many(
        [
            drawn(1.0, True),  # probation, before the timed steps
            published(1),
            drawn(0.6, True),
            published(2),
            drawn(0.2, True),
            drawn(0.1, False),
            drawn(0.3, False),
            drawn(0.5, False, completion=b""),  # an abandoned assignment's own draw
            drawn(0.0, False),  # a member of a group that failed before its draw
        ]
    )
    ledger.close()
    rate, audited = bench.drawn_rates(tmp_path / "l.sqlite", 2)
    assert rate == pytest.approx(0.2) and audited == pytest.approx(1 / 3)
    rate, audited = bench.drawn_rates(tmp_path / "l.sqlite", 0)  # the whole run
    assert rate == pytest.approx((1.0 + 0.6 + 0.6) / 5) and audited == pytest.approx(3 / 5)
    assert bench.drawn_rates(tmp_path / "l.sqlite", 3) == (None, None)  # never published


def test_smollm2_dir_without_a_model_is_skipped_with_a_reason(tmp_path: Path) -> None:
    path, why = bench.smollm2_dir(str(tmp_path))
    assert path is None and why is not None and "smollm2-135m" in why


@pytest.mark.slow  # about 30 s: test_tiny_run_prints_json_last runs the same comparison once
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
    assert demo["params"] > 0 and demo["trust_on_samples_per_s"] > 0
    assert result["trust_ratios"] == {"demo": demo["trust_ratio"]} and demo["trust_ratio"] > 0
    assert demo["trust_off_calls"] == {} and demo["trust_off_counts"]["passes"] == 2  # + warm-up
    # prooftrain's side warms up until its one contributor's 32 probation completions are
    # audited (4 a step), then runs at the lower reputation-driven rate.
    assert demo["warmup_steps"] == 1 + 32 // 4 and demo["baseline_warmup_steps"] == 1
    assert demo["trust_on_verdicts"] == 2 * (1 + 1 + 32 // 4)
    assert 0 < demo["audit_rate_timed"] < 1
    assert demo["keep_gib"] == 2.0  # every row of the demo model: under 1 GiB, plus 1
    phases = demo["trust_on_phases_s"]
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
    assert demo["trust_on_peak_rss_mib"] > 0
    runs = result["aggregation_memory"]["runs"]
    assert [r["contributors"] for r in runs] == [4, 8]
    assert all(r["params"] == 4096 and r["finite"] for r in runs)
    if demo["trl_ratio"] is None:
        assert result["skipped"] == bench.TRL_MISSING
    else:
        assert demo["trl_ratio"] > 0 and demo["trl_peak_rss_mib"] > 0
        assert result["trl_ratios"] == {"demo": demo["trl_ratio"]}


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
