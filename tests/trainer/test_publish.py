"""Trainer-side weight publication: stage publishers, signed manifests, the local store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.release_world import tiny_llama_fixtures, train_step
from trainer.publish import (
    LocalPolicyStore,
    PublishHook,
    ShardInfo,
    StagePublisher,
    build_manifest,
    publish_version,
)
from trainer.stages import Stage, load_stage
from verify.errors import ConfigError, Reason, VerificationError
from verify.keys import SigningKey
from verify.manifest import blob_digest, check_chain, check_manifest
from verify.weights_codec import Int8Block, apply_state_delta, encode_state_delta

TRAINER = SigningKey.from_seed(b"\x41" * 32)
BASE = b"\xba" * 32
CODECS = {
    "fp32": ("fp32", {}),
    "int8": ("int8-block", {"block_size": 64}),
    "topk": ("topk", {"fraction": 0.02, "int8": True}),
}


def run_chain(
    model_dir: Path,
    store_dir: Path,
    *,
    num_stages: int,
    versions: int,
    codec: str = "topk",
    snapshot_every: int = 0,
    seed: int = 0,
) -> tuple[list[Stage], list[StagePublisher], list]:
    """Train-and-publish ``versions`` steps; returns (stages, publishers, sealed manifests)."""
    from rollout.sync import base_model_digest

    torch.manual_seed(seed)
    stages = [load_stage(model_dir, s, num_stages) for s in range(num_stages)]
    name, params = CODECS[codec]
    pubs = [
        StagePublisher.for_stage(st, s, name, params, snapshot_every) for s, st in enumerate(stages)
    ]
    store = LocalPolicyStore(store_dir)
    base = base_model_digest(model_dir)
    gen = torch.Generator().manual_seed(seed)
    sealed, parent = [], None
    for v in range(1, versions + 1):
        train_step(stages, gen)
        parent = publish_version(
            pubs,
            [dict(st.named_parameters()) for st in stages],
            store,
            parent=parent,
            base_digest=base,
            trainer_key=TRAINER,
            now_ms=1_000 + v,
        )
        sealed.append(parent)
    return stages, pubs, sealed


untied, tied = tiny_llama_fixtures()


def _state(n: int = 300, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n, generator=g), "b.weight": torch.randn(4, 5, generator=g)}


def test_published_copy_is_the_contributor_decode() -> None:
    init = _state()
    pub = StagePublisher(0, init, "topk", {"fraction": 0.05})
    current = {k: v + 0.01 * torch.randn_like(v) for k, v in init.items()}
    update = pub.update(current)
    assert update.kind == "delta" and update.codec == "topk"
    assert update.digest == blob_digest(update.blob) and update.nbytes == len(update.blob)
    expect = apply_state_delta(init, update.blob)
    for name, value in pub.published_state().items():
        assert torch.equal(value, expect[name])
        assert not torch.equal(value, current[name])  # lossy: top 5% only


def test_implicit_error_feedback_sends_what_was_dropped() -> None:
    init = _state(2_000)
    pub = StagePublisher(0, init, "topk", {"fraction": 0.05})
    current = {k: v + 0.01 for k, v in init.items()}  # one step, then the trainer idles
    gaps = []
    for _ in range(25):
        pub.update(current)
        gaps.append(
            sum(float((current[k] - v).abs().max()) for k, v in pub.published_state().items())
        )
    assert gaps[-1] < 1e-2 * gaps[0]


def test_train_on_published_uses_explicit_feedback() -> None:
    init = _state(2_000)
    pub = StagePublisher(0, init, "topk", {"fraction": 0.05}, train_on="published")
    weights = {k: v.clone() for k, v in init.items()}
    target = {k: v + 0.3 for k, v in init.items()}
    for _ in range(30):  # each step moves the trained weights 1% towards the target
        step = {k: weights[k] + 0.01 * (target[k] - init[k]) for k in weights}
        pub.update(step)
        weights = {k: v.clone() for k, v in pub.published_state().items()}  # train on published
    moved = sum(float((weights[k] - init[k]).mean()) for k in weights) / len(weights)
    # 30 steps of 0.003 = 0.09; topk 5% alone would move 5% of that. The residual
    # (bounded, a fraction of the total) is all that has not arrived yet.
    assert 0.5 * 0.09 < moved <= 0.09 + 1e-4


def test_full_snapshot_cadence_is_exact() -> None:
    init = _state()
    pub = StagePublisher(3, init, "int8-block", {}, snapshot_every=3)
    kinds = []
    for step in range(1, 7):
        current = {k: v + 0.1 * step for k, v in init.items()}
        update = pub.update(current)
        kinds.append((update.kind, update.codec, update.stage))
        if update.kind == "full":
            for name, value in pub.published_state().items():
                assert torch.equal(value, current[name])
    assert [k for k, _, _ in kinds] == ["delta", "delta", "full"] * 2
    assert {c for k, c, _ in kinds if k == "full"} == {"fp32"}
    assert {s for _, _, s in kinds} == {3}


def test_update_refuses_bad_input_without_advancing() -> None:
    init = _state()
    pub = StagePublisher(0, init, "int8-block")
    with pytest.raises(ValueError, match="lacks"):
        pub.update({"a.weight": init["a.weight"]})
    bad = dict(init, **{"a.weight": torch.full_like(init["a.weight"], float("nan"))})
    with pytest.raises(ValueError, match="finite"):
        pub.update(bad)
    assert pub.version == 0
    with pytest.raises(ConfigError):
        StagePublisher(0, init, "nope")
    with pytest.raises(ConfigError):
        StagePublisher(0, init, "topk", {"fraction": 2.0})


def test_load_into_copies_published_weights() -> None:
    model = torch.nn.Linear(8, 4)
    pub = StagePublisher(0, dict(model.named_parameters()), "int8-block")
    current = {k: v.detach() + 0.5 for k, v in model.named_parameters()}
    pub.update(current)
    pub.load_into(model)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), pub.published_state()[name])


def test_build_manifest_checks_stages_versions_and_codecs() -> None:
    infos = [
        ShardInfo(1, b"\x01" * 32, 10, "delta", "topk"),
        ShardInfo(0, b"\x00" * 32, 12, "delta", "topk"),
    ]
    v1 = build_manifest(1, None, BASE, infos, "topk", TRAINER, 5)
    m1 = check_manifest(v1, TRAINER.public)
    assert [s.stage for s in m1.shards] == [0, 1] and m1.parent_digest == b""
    v2 = build_manifest(2, v1, BASE, infos, "topk", TRAINER, 6)
    assert [m.version for m in check_chain([v1, v2], TRAINER.public)] == [1, 2]
    with pytest.raises(ConfigError):
        build_manifest(2, None, BASE, infos, "topk", TRAINER, 5)
    with pytest.raises(ConfigError):
        build_manifest(3, v1, BASE, infos, "topk", TRAINER, 5)
    with pytest.raises(ConfigError):
        build_manifest(1, None, BASE, infos[:1], "topk", TRAINER, 5)
    with pytest.raises(ConfigError):
        build_manifest(1, None, BASE, infos, "int8-block", TRAINER, 5)


def test_local_store_refuses_equivocation(tmp_path: Path) -> None:
    store = LocalPolicyStore(tmp_path)
    assert store.latest() == 0
    info = [ShardInfo(0, store.put_blob(b"blob"), 4, "delta", "topk")]
    a = build_manifest(1, None, BASE, info, "topk", TRAINER, 1)
    b = build_manifest(1, None, BASE, info, "topk", TRAINER, 2)
    store.publish(a)
    store.publish(a)  # idempotent
    with pytest.raises(VerificationError) as err:
        store.publish(b)
    assert err.value.reason is Reason.WRONG_MANIFEST
    assert store.manifest(1) == a and store.latest() == 1
    assert store.blob(info[0].digest) == b"blob"
    with pytest.raises(VerificationError) as err:
        store.manifest(2)
    assert err.value.reason is Reason.NOT_FOUND


@pytest.mark.parametrize("num_stages", [1, 3])
def test_tied_embedding_is_published_once(tied: Path, tmp_path: Path, num_stages: int) -> None:
    stages, pubs, sealed = run_chain(tied, tmp_path, num_stages=num_stages, versions=3)
    published = [set(p._own) for p in pubs]
    assert sum("model.embed_tokens.weight" in names for names in published) == 1
    assert not any("lm_head.weight" in names for names in published)
    if num_stages > 1:  # the last stage's copy tracks stage 0's published embedding exactly
        first, last = pubs[0].published_state(), pubs[-1].published_state()
        assert torch.equal(first["model.embed_tokens.weight"], last["lm_head.weight"])
    assert len(check_chain(sealed, TRAINER.public)) == 3


def _demo_model_dir() -> Path:
    from trainer.base_model import BUILD_INFO, BaseModelConfig, cache_path

    path = cache_path(BaseModelConfig(task="arithmetic"), 0)
    if not (path / BUILD_INFO).is_file():
        pytest.skip("demo base model is not built (prooftrain base-model)")
    return path


def test_compression_ratio_on_demo_model() -> None:
    model_dir = _demo_model_dir()
    stage = load_stage(model_dir, 0, 1)
    state = {n: p.detach() for n, p in stage.named_parameters()}
    bf16_bytes = 2 * sum(t.numel() for t in state.values())
    gen = torch.Generator().manual_seed(0)
    step = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in state.items()}
    ratios = {}
    for key, (name, params) in CODECS.items():
        pub = StagePublisher(0, state, name, params)
        ratios[key] = bf16_bytes / pub.update(step).nbytes
    assert 0.45 < ratios["fp32"] < 0.5
    assert 1.8 < ratios["int8"] < 2.0
    assert ratios["topk"] >= 10


def test_publish_hook_resumes_from_its_checkpoint(untied: Path, tmp_path: Path) -> None:
    from rollout.sync import PolicySync, base_model_digest

    store = LocalPolicyStore(tmp_path)
    stage = load_stage(untied, 0, 1)
    gen = torch.Generator().manual_seed(3)

    def hook_for(stage: Stage) -> PublishHook:
        pub = StagePublisher.for_stage(stage, 0, "topk", {"fraction": 0.05}, train_on="published")
        return PublishHook(
            pub, store, base_digest=base_model_digest(untied), trainer_key=TRAINER, now_ms=lambda: 7
        )

    hook = hook_for(stage)
    for v in (1, 2):
        train_step([stage], gen)
        assert hook(v, stage) is not None
    saved = hook.state()
    resumed = hook_for(stage)  # a restarted process: fresh publisher, same stage weights
    resumed.load_state(saved)
    train_step([stage], gen)
    resumed(3, stage)
    rebuilt = PolicySync(untied, TRAINER.public, store.manifest, store.blob, 1).state_at(3)
    for name, p in stage.named_parameters():  # train_on="published": the stage holds v3
        assert torch.equal(p.detach(), rebuilt[name])
    with pytest.raises(ConfigError):
        resumed(5, stage)
    assert resumed.publisher.version == 3


def test_bench_weights_smoke() -> None:
    import json
    import subprocess
    import sys

    _demo_model_dir()
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "bench/weights.py", "--steps", "2"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weights" and result["topk_meets_target"] is True
    assert result["codecs"]["topk-2%-int8"]["ratio_vs_bf16"] >= 10
    assert result["pass_at_1"] is None and "pass_at_1_note" in result
    apply = result["int8_apply"]  # the in-place update against decoding its own blob
    assert apply["same_blobs"] is True and apply["published_copies_bit_identical"] is True
    assert apply["versions_compared"] == 2
    assert apply["seconds_per_update"] > 0 and apply["decode_to_apply_seconds_per_update"] > 0


def test_bench_weights_baseline_compares_every_version_and_sees_a_difference() -> None:
    from bench.weights import _DecodingPublisher

    ref = _DecodingPublisher({"w": torch.zeros(64)}, "int8-block", {})
    ref.update({"w": torch.full((64,), 0.5)})
    ref.check(encode_state_delta({"w": torch.full((64,), 0.5)}, Int8Block()))
    assert ref.same_blobs and ref.compared == 1
    ref.check(b"another blob")  # the publisher first this time
    ref.update({"w": torch.ones(64)})
    assert not ref.same_blobs and ref.compared == 2
