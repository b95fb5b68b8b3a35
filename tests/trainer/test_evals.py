"""Evals and the shared generation helper."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rewards.tasks import generate as generate_problems
from trainer.base_model import BaseModelConfig, build_base_model
from trainer.evals import (
    EvalReport,
    eval_completions,
    evaluate,
    load_policy,
    mean_interval,
    pass_at_k,
    wilson_interval,
)
from trainer.generate import SamplingParams, generate

REPO = Path(__file__).resolve().parents[2]
TINY = BaseModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, batch_size=32,
    max_steps=30, eval_every=30, train_pool=400, dev_size=16, target_dev_accuracy=0.99,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_base_model(TINY, 0, tmp_path_factory.mktemp("m") / "model", progress=False).path


@pytest.fixture(scope="module")
def policy(model_dir):
    return load_policy(model_dir, "cpu")


# -- statistics ---------------------------------------------------------------------------


def test_pass_at_k_matches_definition():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)
    assert pass_at_k(4, 2, 3) == 1.0  # fewer failures than k
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_wilson_interval():
    lo, hi = wilson_interval(20, 100)
    assert lo == pytest.approx(0.1333, abs=1e-3) and hi == pytest.approx(0.2888, abs=1e-3)
    assert wilson_interval(0, 50)[0] == 0.0 and wilson_interval(50, 50)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval():
    m, lo, hi = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5
    assert hi - m == pytest.approx(1.959963984540054 * math.sqrt((5 / 3) / 4))
    assert mean_interval([7.0]) == (7.0, 7.0, 7.0)


# -- generation ---------------------------------------------------------------------------


def full_recompute_greedy(model, tok, prompt, steps):
    ids = tok(prompt)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
    return out


def test_cached_batched_greedy_equals_full_recompute(policy):
    model, tok = policy
    prompts = ["12+34=", "9-87=", "reverse abc:", "1+1="]  # different lengths: left padding
    outs = generate(model, tok, prompts, SamplingParams(max_new_tokens=6), batch_size=4)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == full_recompute_greedy(model, tok, prompt, 6)
        alone = generate(model, tok, [prompt], SamplingParams(max_new_tokens=6))[0]
        assert alone.token_ids == out.token_ids
        assert alone.logprobs == pytest.approx(out.logprobs, abs=1e-4)
        assert all(lp <= 0 for lp in out.logprobs)
        assert out.finished == (out.token_ids[-1] == tok.eos_token_id)


def test_sampling_is_seeded(policy):
    model, tok = policy
    prompts = ["12+34=", "56-7="]
    a = generate(
        model,
        tok,
        prompts,
        SamplingParams(max_new_tokens=5, temperature=1.0, seed=3),
        num_samples=4,
    )
    b = generate(
        model,
        tok,
        prompts,
        SamplingParams(max_new_tokens=5, temperature=1.0, seed=3),
        num_samples=4,
    )
    c = generate(
        model,
        tok,
        prompts,
        SamplingParams(max_new_tokens=5, temperature=1.0, seed=4),
        num_samples=4,
    )
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert [x.prompt for x in a] == ["12+34="] * 4 + ["56-7="] * 4


# -- evaluate -----------------------------------------------------------------------------


def test_evaluate_report(model_dir):
    report = evaluate(
        model_dir, "arithmetic", "heldout", n=24, k=2, samples=3, seed=1, device="cpu"
    )
    assert isinstance(report, EvalReport) and report.problems == 24
    names = [m.name for m in report.metrics]
    assert names == [
        "pass@1 (greedy)",
        "pass@2 (T=1, 3 samples)",
        "mean reward (greedy)",
        "mean length (greedy, tokens)",
    ]
    for m in report.metrics[:3]:
        assert 0.0 <= m.ci_low <= m.value <= m.ci_high <= 1.0 or math.isclose(m.ci_low, m.value)
    length = report.metric("mean length (greedy, tokens)")
    assert 1 <= length.value <= report.settings["max_new_tokens"]
    assert json.loads(json.dumps(report.to_json()))["metrics"]["pass@1 (greedy)"]["n"] == 24
    assert "pass@1 (greedy)" in report.to_table()
    again = evaluate(model_dir, "arithmetic", "heldout", n=24, k=2, samples=3, seed=1, device="cpu")
    assert again.to_json() == report.to_json()


def test_evaluate_accepts_a_loaded_policy_and_explicit_problems(policy):
    problems = generate_problems("reverse_text", "heldout", 8, seed=0)
    report = evaluate(policy, problems=problems, k=1, split="heldout")
    assert report.task == "reverse_text" and len(report.metrics) == 3


def test_evaluate_counts_every_completion_as_its_batch_finishes(policy):
    problems = generate_problems("arithmetic", "heldout", 10, seed=0)
    counts: list[int] = []
    evaluate(policy, problems=problems, k=2, samples=3, batch_size=8, progress=counts.append)
    # 10 greedy in batches of 8, then 10 x 3 sampled in batches of 8
    assert counts == [8, 2, 8, 8, 8, 6]
    assert sum(counts) == eval_completions(10, 2, 3) == 40
    assert eval_completions(10, 1) == 10


@pytest.mark.slow  # about 25 s; test_eval_cli_reports_progress_as_lines_in_a_log runs the CLI
def test_eval_cli_table_and_json(model_dir, tmp_path):
    base = [
        sys.executable,
        "-m",
        "node.cli",
        "eval",
        str(model_dir),
        "--task",
        "arithmetic",
        "-n",
        "12",
        "-k",
        "2",
        "--device",
        "cpu",
    ]
    table = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "pass@1 (greedy)" in table.stdout and "95% CI" in table.stdout
    js = subprocess.run([*base, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert doc["problems"] == 12 and "pass@2 (T=1, 2 samples)" in doc["metrics"]
    data = tmp_path / "probs.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "answer": "4", "task": "arithmetic"}) + "\n")
    from_file = subprocess.run(
        [*base, "--data", str(data), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["split"] == "probs.jsonl"
    missing = subprocess.run(
        [sys.executable, "-m", "node.cli", "eval", str(tmp_path / "absent")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr  # a usage error
    assert f"the model directory {tmp_path / 'absent'} does not exist" in missing.stderr


def test_eval_cli_reports_progress_as_lines_in_a_log(model_dir):
    run = subprocess.run(
        [sys.executable, "-m", "node.cli", "eval", str(model_dir), "-n", "12", "-k", "2"]
        + ["--batch-size", "8", "--device", "cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr  # stderr is a pipe: whole lines, no redrawn bar
    lines = run.stderr.splitlines()
    # 12 greedy completions and 12 x 2 sampled ones, in batches of 8
    assert lines[0].startswith("evaluating: 0/36 completions (0%)")
    assert lines[-1].startswith("evaluating: 36/36 completions (100%)")
    assert "pass@1 (greedy)" in run.stdout
