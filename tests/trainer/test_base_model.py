"""Base-model builder: deterministic, cached, loadable with the Auto classes, weak but not hopeless."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from trainer.base_model import (
    BUILD_INFO,
    BaseModelConfig,
    build_base_model,
    ensure_base_model,
    weights_digest,
)
from verify.manifest import base_model_digest

REPO = Path(__file__).resolve().parents[2]
TINY = BaseModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    batch_size=32,
    max_steps=40,
    eval_every=20,
    train_pool=500,
    dev_size=32,
    target_dev_accuracy=0.99,
)


@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    a = build_base_model(TINY, 0, root / "a", progress=False)
    b = build_base_model(TINY, 0, root / "b", progress=False)
    c = build_base_model(TINY, 1, root / "c", progress=False)
    return a, b, c


def test_same_seed_same_weights_digest(tiny_builds):
    a, b, c = tiny_builds
    assert a.weights_digest == b.weights_digest == weights_digest(a.path)
    assert c.weights_digest != a.weights_digest
    assert (a.path / "model.safetensors").read_bytes() == (
        b.path / "model.safetensors"
    ).read_bytes()
    info = json.loads((a.path / BUILD_INFO).read_text())
    assert info["weights_digest"] == a.weights_digest and info["seed"] == 0 and info["steps"] == 40


def test_the_build_digest_is_the_one_manifests_and_release_cards_name(tiny_builds):
    """Issue 37: the build printed a sha256 of its tensors while manifests, /v1/info and the
    release card name ``base_model_digest`` (trainer/release.py); one digest for the base."""
    a = tiny_builds[0]
    assert a.weights_digest == base_model_digest(a.path).hex()
    assert (
        json.loads((a.path / BUILD_INFO).read_text())["weights_digest"]
        == base_model_digest(a.path).hex()
    )


def test_loads_with_auto_classes(tiny_builds):
    path = tiny_builds[0].path
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("12+34=")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "12+34="
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert model.config.eos_token_id == tok.eos_token_id


def test_build_restores_global_torch_state(tiny_builds):
    assert not torch.are_deterministic_algorithms_enabled()


def test_ensure_base_model_builds_once(tmp_path, monkeypatch):
    import trainer.base_model as bm

    calls = []
    real = bm.build_base_model

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(bm, "build_base_model", counting)
    p1 = ensure_base_model("arithmetic", 0, tmp_path, TINY, progress=False)
    p2 = ensure_base_model("arithmetic", 0, tmp_path, TINY, progress=False)
    assert p1 == p2 and len(calls) == 1
    assert p1.name == f"arithmetic-0-{TINY.digest()}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_config_rejects_unknown_and_out_of_range():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        BaseModelConfig(hidden=3)
    with pytest.raises(ValidationError):
        BaseModelConfig(target_dev_accuracy=1.5)


def test_cli_build_smoke(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(
        "[base_model]\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nintermediate_size = 32\n"
        "batch_size = 8\nmax_steps = 3\neval_every = 3\ntrain_pool = 64\ndev_size = 16\n"
    )
    out = tmp_path / "model"
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "base-model",
        "build",
        "--out",
        str(out),
        "--config",
        str(cfg),
        "--quiet",
    ]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "base digest:" in first.stdout and (out / "model.safetensors").is_file()
    again = subprocess.run([*cmd, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    info = json.loads(again.stdout)
    assert info["cached"] is True and info["weights_digest"] in first.stdout
    assert info["weights_digest"] == base_model_digest(out).hex()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "base-model",
            "build",
            "--config",
            str(tmp_path / "nope.toml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error:")


@pytest.mark.slow
def test_full_build_is_deterministic_and_weak_but_not_hopeless(tmp_path):
    from trainer.evals import evaluate

    torch.set_num_threads(1)
    config = BaseModelConfig()
    a = build_base_model(config, 0, tmp_path / "a", progress=False)
    b = build_base_model(config, 0, tmp_path / "b", progress=False)
    assert a.weights_digest == b.weights_digest
    assert a.seconds < 300
    report = evaluate(a.path, "arithmetic", "heldout", n=500, k=1, device="cpu")
    assert 0.10 <= report.metric("pass@1 (greedy)").value <= 0.40


def test_build_progress_in_a_log_is_whole_lines(tmp_path, capsys):
    """stderr is not a terminal here: plain lines, no redrawn bar (the library's own bars are
    off, as ``prooftrain base-model build`` turns them off)."""
    config = TINY.model_copy(update={"max_steps": 4, "eval_every": 2})
    hf_logging.disable_progress_bar()
    try:
        build_base_model(config, 0, tmp_path / "m", progress=True)
    finally:
        hf_logging.enable_progress_bar()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("base model arithmetic: ")]
    assert lines[0].startswith("base model arithmetic: 0/4 step (0%)")
    assert lines[-1].startswith("base model arithmetic: 4/4 step (100%)")
