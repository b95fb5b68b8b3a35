"""Pipeline stages: S = 1, 2, 4 agree with the full model; stages hold only their own weights."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.oracle import TransformersOracle
from trainer.launch import init_distributed, run_torchrun, spawn
from trainer.pipeline import (
    PipelineError,
    PipelineRunner,
    split_microbatches,
    token_logprobs,
)
from trainer.pipeline_oracle import PipelineOracle
from trainer.stages import (
    EMBED_KEY,
    LM_HEAD_KEY,
    load_stage,
    partition_layers,
    save_stage,
    shard_file_name,
    split_model,
    write_index,
)
from verify.errors import ConfigError
from verify.spotcheck import LogprobOracle, OracleRequest

VOCAB, B, T, M = 32, 8, 12, 4
LR = 1e-2
# Shape of every test model here: 4 layers, 4 query heads over 2 key/value heads.
DIMS: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}


def _make_model(path: Path, tied: bool) -> Path:
    torch.manual_seed(1234)
    config = LlamaConfig(**DIMS, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("tiny_llama")
    return {tied: _make_model(root / f"tied_{tied}", tied) for tied in (True, False)}


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[6, 5:] = 0
    advantages = torch.randn(B, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "advantages": advantages}


def _pg_loss(logprobs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient-shaped loss over valid target tokens."""
    valid = mb["attention_mask"][:, 1:].to(logprobs.dtype)  # (b, T-1)
    loss = -(logprobs * mb["advantages"][:, None] * valid).sum() / valid.sum()
    return loss, {"train/tokens": float(valid.sum())}


_REFS: dict[Path, dict[str, Any]] = {}


def _reference(model_dir: Path) -> dict[str, Any]:
    """The full model in one process: logprobs, one Adam step over M micro-batches."""
    if model_dir not in _REFS:
        _REFS[model_dir] = _compute_reference(model_dir)
    return _REFS[model_dir]


def _compute_reference(model_dir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    batch = _batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = token_logprobs(logits, batch["input_ids"])
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for mb in split_microbatches(batch, M):
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss, _ = _pg_loss(token_logprobs(logits, mb["input_ids"]), mb)
        (loss / M).backward()
        losses.append(float(loss.detach()))
    opt.step()
    params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return {"logprobs": lp, "loss": sum(losses) / M, "params": params}


def _train(rank: int, world: int, model_dir: str, save_dir: str) -> dict[str, Any]:
    stage = load_stage(model_dir, rank, world)
    runner = PipelineRunner(stage, rank, world, num_microbatches=M, seed=0)
    batch = _batch()
    lp_last = runner.logprobs(batch["input_ids"], batch["attention_mask"])
    lp_first = runner.logprobs(batch["input_ids"], batch["attention_mask"], to_rank=0)
    opt = torch.optim.Adam(stage.parameters(), lr=LR)
    opt.zero_grad()
    result = runner.forward_backward(batch, _pg_loss)
    opt.step()
    save_stage(stage, save_dir)
    if rank == 0:
        write_index(stage.config, save_dir, world)
    names_by_id = {id(p): n for n, p in stage.named_parameters()}
    return {
        "state_names": sorted(stage.state_dict()),
        "param_names": sorted(names_by_id.values()),
        "opt_names": sorted(names_by_id[id(p)] for p in opt.state),
        "loaded_keys": sorted(stage.loaded_keys),
        "tied_copies": dict(stage.tied_copies),
        "held_numel": sum(p.numel() for p in stage.parameters()),
        "buffer_names": sorted(n for n, _ in stage.named_buffers()),
        "params": {n: p.detach().clone() for n, p in stage.state_dict().items()},
        "loss": result.loss,
        "metrics": result.metrics,
        "lp_last": lp_last,
        "lp_first": lp_first,
    }


def _fail(rank: int, world: int, model_dir: str, bad_rank: int) -> dict[str, Any]:
    """Stage ``bad_rank`` raises in its second forward; every rank reports what it saw."""
    stage = load_stage(model_dir, rank, world)
    runner = PipelineRunner(stage, rank, world, num_microbatches=M)
    calls = {"n": 0}

    def explode(*_: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault in stage forward")

    if rank == bad_rank:
        stage.register_forward_pre_hook(explode)
    out: dict[str, Any] = {"error": None, "again": None}
    try:
        runner.forward_backward(_batch(), _pg_loss)
    except PipelineError as exc:
        out["error"] = str(exc)
    try:
        runner.forward_backward(_batch(), _pg_loss)
    except PipelineError as exc:
        out["again"] = str(exc)
    return out


def _oracle_requests() -> list[OracleRequest]:
    g = torch.Generator().manual_seed(3)
    shapes = [(10, 4, 1.0, 0, 1.0), (7, 1, 0.7, 5, 1.0), (12, 11, 1.3, 0, 0.8), (5, 3, 1.0, 0, 1.0)]
    return [
        OracleRequest(tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()), p, t, k, q)
        for n, p, t, k, q in shapes
    ]


def _oracle(rank: int, world: int, dirs: dict[str, str]) -> dict[str, Any]:
    """Rank 0 asks the pipeline for two policy versions; the other ranks serve."""
    versions = {0: dirs["tied"], 1: dirs["untied"]}
    oracle = PipelineOracle(versions.__getitem__, rank, world)
    if rank != 0:
        oracle.serve()
        return {}
    reqs = _oracle_requests()
    out: dict[str, Any] = {v: oracle.logprobs_batch(v, reqs) for v in (1, 0)}
    with pytest.raises(KeyError):
        oracle.logprobs_batch(7, reqs)
    r = reqs[1]
    out["single"] = oracle.logprobs(0, r.input_ids, r.prompt_len, r.temperature, r.top_k, r.top_p)
    out["logits"] = oracle.completion_logits(1, r.input_ids, r.prompt_len)
    oracle.close()
    return out


def _worker(rank: int, world: int, dirs: dict[str, str], save_root: str) -> dict[str, Any]:
    """One process start per stage count (imports dominate the cost): every scenario."""
    out = {kind: _train(rank, world, d, f"{save_root}/{kind}-S{world}") for kind, d in dirs.items()}
    out["oracle"] = _oracle(rank, world, dirs)
    if world >= 3:
        out["failure"] = _fail(rank, world, dirs["tied"], bad_rank=1)
    return out


_RUNS: dict[int, list[dict[str, Any]]] = {}


def _saved(model_dirs: dict[bool, Path], tied: bool, stages: int) -> Path:
    return model_dirs[True].parent / "saved" / f"{'tied' if tied else 'untied'}-S{stages}"


def _run(model_dirs: dict[bool, Path], stages: int) -> list[dict[str, Any]]:
    if stages not in _RUNS:
        dirs = {"tied": str(model_dirs[True]), "untied": str(model_dirs[False])}
        args = (dirs, str(model_dirs[True].parent / "saved"))
        _RUNS[stages] = spawn(_worker, stages, args, timeout_s=150, group_timeout_s=60)
    return _RUNS[stages]


def _ranks(model_dirs: dict[bool, Path], tied: bool, stages: int) -> list[dict[str, Any]]:
    return [r["tied" if tied else "untied"] for r in _run(model_dirs, stages)]


# -- pure pieces


def test_partition_layers_is_contiguous_and_balanced() -> None:
    specs = partition_layers(10, 4)
    assert [list(s.layers) for s in specs] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert specs[0].is_first and specs[-1].is_last and not specs[1].is_last
    with pytest.raises(ConfigError):
        partition_layers(3, 4)
    with pytest.raises(ConfigError):
        partition_layers(3, 0)


def test_init_distributed_needs_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="RANK"):
        init_distributed()


def test_token_logprobs_definition() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, VOCAB, generator=g)
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    for temp in (1.0, 0.7):
        got = token_logprobs(logits, ids, temp)
        assert got.shape == (2, 4)
        want = torch.log_softmax(logits[0, 2] / temp, dim=-1)[ids[0, 3]]
        assert torch.allclose(got[0, 2], want)
    with pytest.raises(ConfigError):
        token_logprobs(logits, ids, 0.0)


def test_split_microbatches() -> None:
    batch = _batch() | {"scale": 2.0}
    parts = split_microbatches(batch, 4)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat([p["advantages"] for p in parts]), batch["advantages"])
    assert all(p["scale"] == 2.0 for p in parts)
    with pytest.raises(ConfigError):
        split_microbatches(batch, 3)
    with pytest.raises(ConfigError):
        split_microbatches(batch | {"bad": torch.zeros(3)}, 2)


@pytest.mark.parametrize("tied", [True, False])
def test_load_stage_reads_only_its_own_tensors(model_dirs: dict[bool, Path], tied: bool) -> None:
    full = LlamaForCausalLM.from_pretrained(model_dirs[tied]).eval()
    batch = _batch()
    want = full(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for stages in (2, 4):
        loaded = [load_stage(model_dirs[tied], s, stages) for s in range(stages)]
        for split in (loaded, split_model(full, stages)):
            x = batch["input_ids"]
            with torch.no_grad():
                for st in split:
                    x = st(x, batch["attention_mask"])
            assert torch.allclose(x, want, atol=1e-6)
        for st in loaded:
            own = {st.tied_copies.get(n, n) for n in st.state_dict()}
            assert set(st.loaded_keys) == own
            assert not any(p.is_meta for p in st.parameters())
        tied_last = loaded[-1].tied_copies
        assert tied_last == ({LM_HEAD_KEY: EMBED_KEY} if tied else {})
        assert EMBED_KEY not in loaded[-1].state_dict()


@pytest.mark.parametrize("arch", ["mistral-sliding", "qwen2"])
def test_other_llama_layouts_split_exactly(tmp_path: Path, arch: str) -> None:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**DIMS, tie_word_embeddings=True))
    else:
        model = MistralForCausalLM(MistralConfig(**DIMS, sliding_window=4))
    model.eval().save_pretrained(tmp_path)
    batch = _batch()
    want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    x = batch["input_ids"]
    with torch.no_grad():
        for s in range(2):
            x = load_stage(tmp_path, s, 2)(x, batch["attention_mask"])
    assert torch.allclose(x, want, atol=1e-6)


# -- multi-process


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_matches_full_model(model_dirs: dict[bool, Path], tied: bool, stages: int) -> None:
    ref = _reference(model_dirs[tied])
    ranks = _ranks(model_dirs, tied, stages)
    last, first = ranks[-1], ranks[0]
    assert torch.allclose(last["lp_last"], ref["logprobs"], atol=1e-5)
    assert torch.allclose(first["lp_first"], ref["logprobs"], atol=1e-5)
    assert all(r["lp_last"] is None for r in ranks[:-1])
    assert all(r["loss"] == pytest.approx(ref["loss"], abs=1e-6) for r in ranks)
    assert all(r["metrics"] == last["metrics"] for r in ranks)
    assert last["metrics"]["train/tokens"] > 0
    for r in ranks:
        for name, value in r["params"].items():
            key = r["tied_copies"].get(name, name)
            assert torch.allclose(value, ref["params"][key], atol=1e-5), (stages, name)
    if stages > 1:
        one = _ranks(model_dirs, tied, 1)[0]
        assert ranks[0]["loss"] == pytest.approx(one["loss"], abs=1e-6)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_stages_hold_disjoint_parameters(
    model_dirs: dict[bool, Path], tied: bool, stages: int
) -> None:
    ranks = _ranks(model_dirs, tied, stages)
    full = LlamaForCausalLM.from_pretrained(model_dirs[tied])
    full_names = {n for n, _ in full.named_parameters()}
    full_numel = sum(p.numel() for p in full.parameters())
    seen: set[str] = set()
    for r in ranks:
        own = set(r["state_names"])
        assert own == set(r["param_names"]) == set(r["opt_names"])
        assert not own & seen, "two stages hold the same parameter"
        seen |= own
        assert r["held_numel"] < full_numel
        # The only buffers are the rotary tables, rebuilt from the config.
        assert set(r["buffer_names"]) <= {"rotary_emb.inv_freq", "rotary_emb.original_inv_freq"}
    copies = {n for r in ranks for n in r["tied_copies"]}
    assert copies == ({LM_HEAD_KEY} if tied else set())
    # Coverage: every parameter of the model lives on exactly one stage (the tied
    # lm_head is the declared copy of the embedding).
    assert seen - copies == full_names
    assert sum(r["held_numel"] for r in ranks) == full_numel + (
        full.model.embed_tokens.weight.numel() if tied else 0
    )


def test_stage_failure_ends_step_on_every_rank(model_dirs: dict[bool, Path]) -> None:
    ranks = [r["failure"] for r in _run(model_dirs, 4)]
    assert "injected fault in stage forward" in ranks[1]["error"]
    assert "forward of micro-batch 1" in ranks[1]["error"]
    for r in (0, 2, 3):
        assert ranks[r]["error"] is not None and f"stage {r}/4 failed" in ranks[r]["error"]
    # Peers learn of the failure from the torn-down group, not from its 60 s timeout.
    assert not any(word in r["error"].lower() for r in ranks for word in ("timeout", "timed out"))
    assert all("refuses" in r["again"] for r in ranks)


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_saved_stages_form_a_resharding_checkpoint(
    model_dirs: dict[bool, Path], tied: bool, stages: int
) -> None:
    ref = _reference(model_dirs[tied])
    _run(model_dirs, stages)
    saved = _saved(model_dirs, tied, stages)
    assert sorted(p.name for p in saved.glob("*.safetensors")) == [
        shard_file_name(s, stages) for s in range(stages)
    ]
    full = LlamaForCausalLM.from_pretrained(saved)
    for name, value in full.state_dict().items():
        assert torch.allclose(value, ref["params"][name], atol=1e-5), name
    # Resume with a different stage count reads the same weights.
    for st in (load_stage(saved, s, 4 // stages) for s in range(4 // stages)):
        for name, value in st.state_dict().items():
            key = st.tied_copies.get(name, name)
            assert torch.equal(value, full.state_dict()[key]), name


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_oracle_matches_single_process_oracle(model_dirs: dict[bool, Path], stages: int) -> None:
    got = _run(model_dirs, stages)[0]["oracle"]
    reference = TransformersOracle({0: model_dirs[True], 1: model_dirs[False]})
    reqs = _oracle_requests()
    for version in (0, 1):
        want = reference.logprobs_batch(version, reqs)
        for g, w, r in zip(got[version], want, reqs, strict=True):
            assert g.shape == (r.completion_len,)
            np.testing.assert_allclose(g, w, atol=1e-5)
    assert not np.allclose(got[0][0], got[1][0], atol=1e-3)  # versions differ
    np.testing.assert_allclose(got["single"], got[0][1], atol=1e-6)
    r = reqs[1]
    want_logits = reference.completion_logits(1, r.input_ids, r.prompt_len)
    np.testing.assert_allclose(got["logits"], want_logits, atol=1e-5)
    assert isinstance(PipelineOracle(lambda v: "", 0, 1), LogprobOracle)


# -- torchrun entry point (this file doubles as the worker script)


def test_torchrun_resumes_from_checkpoint_after_stage_failure(
    model_dirs: dict[bool, Path], tmp_path: Path
) -> None:
    """Step 0 checkpoints; step 1 fails on the last stage; the restart resumes at step 1."""
    done = run_torchrun(
        str(Path(__file__).resolve()),
        2,
        args=["--model-dir", str(model_dirs[True]), "--out", str(tmp_path)],
        max_restarts=1,
        module=False,
        timeout_s=240,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["attempt"] for r in results] == [1, 1], done.stderr[-2000:]
    assert [r["start_step"] for r in results] == [1, 1]
    failed = json.loads((tmp_path / "failed_loss.json").read_text())
    # Same weights and optimizer state as before the failure, so the same loss.
    assert results[0]["losses"]["1"] == pytest.approx(failed, abs=1e-6)
    assert results[0]["losses"] == results[1]["losses"]


def _torchrun_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out, ckpt = Path(args.out), Path(args.out) / "ckpt"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = init_distributed(timeout_s=60)
    resumed = (ckpt / "step.json").is_file()
    stage = load_stage(ckpt if resumed else args.model_dir, rank, world)
    opt = torch.optim.Adam(stage.parameters(), lr=LR)
    start = 0
    if resumed:
        opt.load_state_dict(torch.load(ckpt / f"optim-{rank}.pt"))
        start = json.loads((ckpt / "step.json").read_text())
    runner = PipelineRunner(stage, rank, world, num_microbatches=1)
    losses: dict[int, float] = {}
    fail_now = {"on": False}

    def loss_fn(lp: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = _pg_loss(lp, mb)
        if fail_now["on"]:
            (out / "failed_loss.json").write_text(json.dumps(float(loss.detach())))
            raise RuntimeError("stage fails on purpose")
        return loss, metrics

    for step in range(start, 2):
        fail_now["on"] = attempt == 0 and step == 1
        opt.zero_grad()
        losses[step] = runner.forward_backward(_batch(), loss_fn).loss
        opt.step()
        save_stage(stage, ckpt)
        torch.save(opt.state_dict(), ckpt / f"optim-{rank}.pt")
        torch.distributed.barrier()
        if rank == 0:
            write_index(stage.config, ckpt, world)
            (ckpt / "step.json").write_text(json.dumps(step + 1))
        torch.distributed.barrier()
    record = {"attempt": attempt, "start_step": start, "losses": losses}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_torchrun_main())
