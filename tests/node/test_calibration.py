"""Calibrated tolerances: no honest rollout is rejected, shifts above the tolerance are caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.validator.calibration import (
    calibrate,
    honest_audit,
    load_tolerance_file,
    write_tolerance_file,
)
from rewards.tasks.base import generate
from verify.errors import ConfigError
from verify.spotcheck import DEFAULT_TOLERANCES


@pytest.fixture(scope="module")
def prompts(codec) -> list[list[int]]:
    return [codec.encode(p.prompt) for p in generate("arithmetic", "train", 260, seed=3)]


@pytest.fixture(scope="module")
def mixed(tiny_model, codec, prompts):
    return calibrate(
        tiny_model, prompts[:10], stop_token_ids=[codec.eos_token_id], max_tokens=12, min_tokens=0
    )


def test_calibration_measures_every_layout_a_node_may_recompute_in(mixed) -> None:
    seen = {(s.generation_dtype, s.backend, s.batch_size, s.layout) for s in mixed.settings}
    assert seen == {
        (d, backend, b, layout)
        for d in ("float32", "bfloat16")
        for backend in ("transformers", "transformers-generate")
        for b in (1, 4, 16)
        for layout in ("packed", "unpacked")
    }
    assert all(s.tokens > 0 for s in mixed.settings)
    # every layout computes the same logprobs up to float32 rounding: the same-precision settings agree
    fp32 = {
        (s.batch_size, s.layout): s.token_max_abs
        for s in mixed.settings
        if s.generation_dtype == "float32"
    }
    assert max(fp32.values()) < 1e-4


def test_calibrating_no_layout_the_model_runs_is_refused(
    tiny_model, codec, prompts, monkeypatch
) -> None:
    from node.validator import calibration

    only = calibration.layout_oracles
    monkeypatch.setattr(
        calibration,
        "layout_oracles",
        lambda *a: {k: v for k, v in only(*a).items() if k == "unpacked"},
    )  # a model that never packs
    with pytest.raises(ConfigError, match="runs none of the layouts"):
        calibrate(
            tiny_model,
            prompts[:2],
            stop_token_ids=[codec.eos_token_id],
            max_tokens=4,
            layouts=("packed",),
        )


def test_two_thousand_honest_audits_give_no_false_positive(
    tiny_model, codec, prompts, mixed
) -> None:
    result = honest_audit(
        tiny_model,
        prompts[10:260],
        mixed.tolerance,
        stop_token_ids=[codec.eos_token_id],
        max_tokens=12,
        shifts=(0.05,),
    )
    print(f"\nmixed-precision tolerance {mixed.token_abs:.4g}/{mixed.chunk_mean_abs:.4g}: {result}")
    assert result["audited"] >= 2_000
    assert result["rejected"] == 0
    assert result["caught"][0.05] == 1.0


def test_same_precision_catches_a_005_nat_shift(tiny_model, codec, prompts) -> None:
    same = calibrate(
        tiny_model,
        prompts[:8],
        stop_token_ids=[codec.eos_token_id],
        max_tokens=12,
        generation_dtypes=("float32",),
        min_tokens=0,
    )
    assert same.token_abs < 0.01
    result = honest_audit(
        tiny_model,
        prompts[8:40],
        same.tolerance,
        stop_token_ids=[codec.eos_token_id],
        max_tokens=12,
        generation_dtypes=("float32",),
        shifts=(0.002, 0.05),
    )
    print(f"\nsame-precision tolerance {same.token_abs:.4g}: {result}")
    assert result["rejected"] == 0
    assert result["caught"][0.05] == 1.0 and result["caught"][0.002] == 1.0


def test_mixed_precision_catches_any_shift_beyond_its_tolerance(
    tiny_model, codec, prompts, mixed
) -> None:
    # Honest noise is at most token_abs / margin (margin 2) and may pull a shift back towards
    # the claim, so a shift is caught for sure from 1.5 x token_abs; a chunk mean is judged
    # only over chunks of MIN_MEAN_TOKENS or more, and these completions have up to 12.
    shift = mixed.token_abs * 1.5 + 1e-4
    result = honest_audit(
        tiny_model,
        prompts[40:60],
        mixed.tolerance,
        stop_token_ids=[codec.eos_token_id],
        max_tokens=12,
        shifts=(shift,),
    )
    assert result["rejected"] == 0 and result["caught"][shift] == 1.0


def test_tolerance_file_round_trip_and_refusal(tmp_path: Path, mixed) -> None:
    path = write_tolerance_file(mixed, tmp_path / "tol.json")
    tol = load_tolerance_file(path, min_tokens=0)
    for dtype in ("float32", "bfloat16"):
        row = mixed.by_precision()[dtype]
        loaded = tol.of(dtype)
        assert loaded.token_abs == pytest.approx(row["token_abs"])
        assert loaded.divergence is not None
        assert loaded.divergence.logprob_null == pytest.approx(row["logprob_null"])
        # the per-token bounds never go below the built-in table's
        assert loaded.token_abs >= DEFAULT_TOLERANCES.of(dtype).token_abs
        assert loaded.cdf_slack >= DEFAULT_TOLERANCES.of(dtype).cdf_slack
    assert (
        tol.of("float32").token_abs < tol.of("bfloat16").token_abs
    )  # each precision its own bound
    with pytest.raises(ConfigError, match="fewer than the 2000"):
        load_tolerance_file(path)  # too few tokens for a node
    data = json.loads(path.read_text())
    bf16 = data["by_precision"]["bfloat16"]
    bf16["token_abs"] = bf16["observed_token_max"] / 2
    bf16["chunk_mean_abs"] = min(bf16["chunk_mean_abs"], bf16["token_abs"])
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="would flag its own honest calibration runs"):
        load_tolerance_file(path, min_tokens=0)


def test_a_tolerance_file_without_the_divergence_statistics_is_refused(
    tmp_path: Path, mixed
) -> None:
    path = write_tolerance_file(mixed, tmp_path / "tol.json")
    data = json.loads(path.read_text())
    for row in data["by_precision"].values():
        del row["logprob_null"]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="lacks 'logprob_null'.*prooftrain calibrate"):
        load_tolerance_file(path, min_tokens=0)


def test_a_calibration_on_too_few_tokens_is_refused_with_what_to_run(
    tiny_model, codec, prompts
) -> None:
    with pytest.raises(ConfigError, match=r"run it again with --prompts \d+"):
        calibrate(
            tiny_model,
            prompts[:2],
            stop_token_ids=[codec.eos_token_id],
            max_tokens=4,
            batch_sizes=(1,),
            backends=("transformers",),
        )


def test_calibration_progress_moves_inside_a_setting_as_plain_lines(
    tiny_model, codec, prompts, capsys, monkeypatch
) -> None:
    import rollout.progress

    monkeypatch.setattr(rollout.progress, "PLAIN_EVERY_S", 0.0)  # a line per update
    calibrate(
        tiny_model,
        prompts[:3],
        stop_token_ids=[codec.eos_token_id],
        generation_dtypes=("float32",),
        backends=("transformers",),
        batch_sizes=(2,),
        layouts=("unpacked",),
        group_size=2,
        max_tokens=4,
        min_tokens=0,
        progress=True,
    )
    lines = [line for line in capsys.readouterr().err.split("\n") if "calibrating" in line]
    assert all("\r" not in line for line in lines)  # stderr is not a terminal: no redrawn bar
    # 3 prompts x 2 rollouts generated, then the same 6 recomputed in the only setting
    assert lines[0].startswith("calibrating: 0/12 rollouts (0%)")
    assert any(line.startswith("calibrating: 2/12 rollouts") for line in lines)
    assert any(
        line.startswith("calibrating: 6/12 rollouts") and "0/1 settings" in line for line in lines
    )
    assert lines[-1].startswith("calibrating: 12/12 rollouts (100%)")
    assert lines[-1].endswith("1/1 settings")
