"""Evals in a worker process: the in-line reports, in order, bounded, failures raised."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.background_evals import BackgroundEvals, EvalWorkerError
from rewards.tasks import generate as generate_problems
from trainer.evals import default_max_new_tokens, evaluate

SEED = 3


@pytest.fixture(scope="module")
def setting(tiny_model: Path):  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    problems = generate_problems("arithmetic", "heldout", 24, SEED)
    max_new = default_max_new_tokens(problems, tokenizer)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return tiny_model, tokenizer, problems, max_new, base


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return out


def test_reports_match_in_line_evals_in_order_even_when_the_model_changes_after(setting) -> None:  # type: ignore[no-untyped-def]
    model_dir, tokenizer, problems, max_new, base = setting
    versions = [base, perturbed(base, 1), perturbed(base, 2), perturbed(base, 3)]
    expected = [
        evaluate(
            (m, tokenizer),
            "arithmetic",
            "heldout",
            k=1,
            samples=1,
            seed=SEED,
            problems=problems,
            max_new_tokens=max_new,
        ).to_json()
        for m in versions
    ]
    assert len({str(e["metrics"]) for e in expected}) > 1  # the versions are told apart

    done = []
    with BackgroundEvals(
        model_dir, "arithmetic", problems, max_new_tokens=max_new, seed=SEED, max_pending=2
    ) as evals:
        for i, m in enumerate(versions):
            scratch = copy.deepcopy(m)
            evals.submit(i, scratch, tag=f"t{i}")
            assert evals.pending <= 2
            done += evals.ready()
            with torch.no_grad():  # the weights were taken at submission
                for p in scratch.parameters():
                    p.zero_()
        done += evals.drain()
        assert evals.pending == 0
        assert evals.drain() == [] and evals.ready() == []
    assert [e.version for e in done] == [0, 1, 2, 3]
    assert [e.tag for e in done] == ["t0", "t1", "t2", "t3"]
    for e, want in zip(done, expected, strict=True):
        got = e.report.to_json()
        assert got["metrics"] == want["metrics"] and got["problems"] == want["problems"] == 24
        assert got["settings"] == want["settings"]


def test_reports_waited_for_while_submitting_are_kept_and_handed_out_once(setting) -> None:  # type: ignore[no-untyped-def]
    model_dir, _, problems, max_new, base = setting
    with BackgroundEvals(
        model_dir, "arithmetic", problems, max_new_tokens=max_new, seed=SEED, max_pending=1
    ) as evals:
        for i in range(4):  # from the second on, each submit waits for the one before
            evals.submit(i, base, tag=i)
            assert evals.pending == 1
        assert [e.version for e in evals.drain()] == [0, 1, 2, 3]
        assert evals.ready() == [] and evals.drain() == []


def test_a_failed_eval_raises_with_the_workers_traceback(setting) -> None:  # type: ignore[no-untyped-def]
    model_dir, _, problems, max_new, base = setting
    wrong = torch.nn.Linear(3, 2)  # another architecture: its state dict does not load
    with BackgroundEvals(
        model_dir, "arithmetic", problems, max_new_tokens=max_new, seed=SEED
    ) as evals:
        evals.submit(7, wrong)
        with pytest.raises(EvalWorkerError, match=r"version 7 failed(.|\n)*state_dict"):
            evals.drain()
        # the worker lives on: the next version evaluates
        evals.submit(8, base)
        [after] = evals.drain()
        assert after.version == 8 and after.report.problems == 24


def test_a_dead_worker_raises_and_is_not_waited_for(setting) -> None:  # type: ignore[no-untyped-def]
    model_dir, _, problems, max_new, base = setting
    evals = BackgroundEvals(model_dir, "arithmetic", problems, max_new_tokens=max_new, seed=SEED)
    try:
        evals._proc.kill()
        evals._proc.join(10)
        with pytest.raises(EvalWorkerError, match="exited"):
            evals.submit(1, base)
            evals.drain()
    finally:
        evals.close()
    assert not evals._proc.is_alive()
