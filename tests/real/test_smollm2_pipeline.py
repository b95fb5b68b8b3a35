"""SmolLM2-135M through the trainer, weight publication and release (issue 36, item 3).

One validator over the fetched model admits four groups (two contributors, two
groups each of 2 x 24 tokens, every rollout audited). On those accepted samples:

(a) the trainer (``TrainerLoop``, mean aggregator) takes two steps with S = 1
    and with S = 2 pipeline stages, each a spawned gloo job; both give the same
    weights (up to float rounding) and the same gradient norms;
(b) the S = 2 result is published as version 1 with every weight codec; the
    rebuilt weights (``PolicySync``, which checks the trainer's signature and the
    blob digests) equal the trainer's published copy bit for bit and the trained
    weights within the codec's error; a flipped blob byte and a manifest signed
    by another key are refused;
(c) version 1 (int8-block) goes through the validator's ledger, a release is
    built and ``prooftrain release verify`` accepts it, and names the file of a
    release whose weights were changed.

A 135M model writes about 24 tokens of a GSM8K answer here, so every reward is
0 and every group would be uniform (zero advantage, zero gradient): the trainer
is fed the accepted samples with their rewards relabelled (group member g gets
g % 2). Everything else is as admitted. Figures print as one JSON line per part
(``-s``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from node.validator.core import Validator
from node.validator.policy import HFTextCodec, model_dir_digest
from rewards.tasks import generate
from rollout.backends import TransformersBackend
from rollout.sync import PolicySync
from rollout.worker import answer
from tests.release_world import TRAINER, VALIDATOR, LedgerSink, make_validator
from trainer.config import AggregatorSection, TrainerConfig
from trainer.evals import eval_statement, evaluate
from trainer.loop import TrainerLoop
from trainer.network_rules import NetworkRules
from trainer.pipeline import PipelineRunner
from trainer.publish import StagePublisher, publish_version
from trainer.release import build_release
from trainer.stages import EMBED_KEY, LM_HEAD_KEY, Stage, load_stage, save_stage, write_index
from verify.errors import Reason, VerificationError
from verify.keys import SigningKey
from verify.manifest import manifest_digest
from verify.signed import open_group_verdict, seal
from verify.types import (
    AcceptedSample,
    PolicyManifest,
    SampleBatch,
    SignedManifest,
    canonical_bytes,
    decode,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASK = "gsm8k"
MAX_TOKENS = 24
GROUP_SIZE = 2
GROUPS_EACH = 2
STEPS = 2
LR = 1e-5
CONTRIBUTORS = (SigningKey.from_seed(b"\xb3" * 32), SigningKey.from_seed(b"\xb4" * 32))
# name -> (codec, params); "topk" at 2% with int8 values is the size target, the rest the
# registry's other encodings.
CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "int8-block": ("int8-block", {"block_size": 64}),
    "topk-2%-int8": ("topk", {"fraction": 0.02, "int8": True}),
    "topk-2%-fp32": ("topk", {"fraction": 0.02, "int8": False}),
}
RELEASE_CODEC = "int8-block"
F32_EPS = 2.0**-23
BF16_SCALE_ROUNDING = 1.0 + 2.0**-7  # int8 scales are absmax / 127 rounded up to bfloat16


def _report(part: str, figures: dict[str, Any]) -> None:
    print(json.dumps({"test": "smollm2_pipeline", "part": part, **figures}, sort_keys=True))


# -- the accepted groups


@dataclass
class World:
    model: Path
    ledger: Path
    validator: Validator
    samples: list[AcceptedSample]
    figures: dict[str, Any]


@pytest.fixture(scope="module")
def world(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("smollm2-world")
    v = make_validator(
        root,
        smollm2,
        {
            "assignment.max_tokens": MAX_TOKENS,
            "assignment.group_size": GROUP_SIZE,
            "assignment.chunk_size": 16,
            "rules.audit_rate": 1.0,
        },
        pool=generate(TASK, "train", 16),
        origin="test/smollm2-pipeline",
    )
    ledger_path, codec = root / "ledger.sqlite", HFTextCodec(smollm2)
    backend = TransformersBackend(smollm2)
    t0 = time.monotonic()
    for i, c in enumerate(CONTRIBUTORS):
        v.register(c.public.raw, f"smollm2-{i}")
    for _ in range(GROUPS_EACH):
        for c in CONTRIBUTORS:
            group = answer(c, v.assign(c.public.raw), v.key.public, backend, codec)
            got = open_group_verdict(v.submit(canonical_bytes(group)), v.key.public)
            assert all(x.accepted and x.audited for x in got), [x.reason for x in got]
    served = v.samples(0, 1_000).samples
    assert len(served) == len(CONTRIBUTORS) * GROUPS_EACH * GROUP_SIZE
    samples = [msgspec.structs.replace(s, reward=float(s.group_index % 2)) for s in served]
    lengths = [len(s.token_ids) // 4 for s in samples]
    prompts = [len(s.prompt_ids) // 4 for s in samples]
    figures = {
        "rollouts": len(samples),
        "completion_tokens_max": max(lengths),
        "prompt_tokens_max": max(prompts),
        "generate_and_audit_s": round(time.monotonic() - t0, 1),
    }
    yield World(smollm2, ledger_path, v, samples, figures)
    v.ledger.close()
    v.state.close()


# -- (a) the trainer with S = 1 and S = 2


class _ListSource:
    """The accepted samples, served by position (the ledger's cursor semantics)."""

    def __init__(self, samples: list[AcceptedSample]) -> None:
        self.samples = [msgspec.structs.replace(s, ledger_index=i) for i, s in enumerate(samples)]

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        out = self.samples[cursor : cursor + limit]
        return SampleBatch(cursor, cursor + len(out), out)


def _train(
    rank: int, world: int, model_dir: str, samples: list[bytes], out_dir: str
) -> dict[str, Any]:
    """One rank of an S = ``world`` trainer: ``STEPS`` steps, then its stage saved."""
    cfg = TrainerConfig(
        model_dir=Path(model_dir),
        task=TASK,
        stages=world,
        steps=STEPS,
        lr=LR,
        batch_groups=len(CONTRIBUTORS),
        aggregator=AggregatorSection(name="mean"),
        rules=NetworkRules(max_staleness=4),
        eval_every=0,
        starve_timeout_s=30,
    )
    decoded = [msgspec.msgpack.decode(b, type=AcceptedSample) for b in samples]
    stage = load_stage(model_dir, rank, world)
    runner = PipelineRunner.for_config(stage, cfg, rank, world)
    loop = TrainerLoop(cfg, runner, _ListSource(decoded), progress=False)
    t0 = time.monotonic()
    history = loop.run()
    seconds = time.monotonic() - t0
    save_stage(stage, out_dir)
    if rank == 0:
        write_index(stage.config, out_dir, world)
    return {
        "metrics": history.metrics,
        "seconds": seconds,
        "one_pass": loop.step_fn.grouped is not None,
    }


def _saved_state(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@dataclass
class Trained:
    dirs: dict[int, Path]
    runs: dict[int, list[dict[str, Any]]]
    wall_s: dict[int, float]


@pytest.fixture(scope="module")
def trained(world: World, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    from trainer.launch import spawn

    root = tmp_path_factory.mktemp("smollm2-trained")
    payload = [msgspec.msgpack.encode(s) for s in world.samples]
    dirs, runs, wall = {}, {}, {}
    for stages in (1, 2):
        dirs[stages] = root / f"S{stages}"
        t0 = time.monotonic()
        runs[stages] = spawn(
            _train,
            stages,
            (str(world.model), payload, str(dirs[stages])),
            timeout_s=900,
            group_timeout_s=300,
        )
        wall[stages] = time.monotonic() - t0
    return Trained(dirs, runs, wall)


def test_s1_and_s2_pipelines_take_the_same_steps(world: World, trained: Trained) -> None:
    base = _saved_state_of_model(world.model)
    one, two = (_saved_state(trained.dirs[s]) for s in (1, 2))
    assert set(one) == set(two) == set(base) - {LM_HEAD_KEY}
    moved = max(float((one[n] - base[n]).abs().max()) for n in one)
    diff = {n: float((one[n] - two[n]).abs().max()) for n in one}
    worst = max(diff, key=diff.__getitem__)
    # Beyond the last bit of the weight itself (one float32 rounding of w - lr * u):
    # the part of the difference that is in the update.
    beyond = {n: float(((one[n] - two[n]).abs() - 2 * F32_EPS * one[n].abs()).max()) for n in one}
    rel_l2 = math.sqrt(
        sum(float((one[n] - two[n]).double().square().sum()) for n in one)
        / sum(float((one[n] - base[n]).double().square().sum()) for n in one)
    )
    # Adam moves every weight with a gradient by about lr. Where a gradient is near zero
    # (|g| ~ eps = 1e-8, many cancelling terms) its float32 rounding, which differs between
    # any two ways of summing it (the one-pass Gram path of S = 1 against S = 2's pass per
    # contributor, or against S = 1's own), moves that weight's update by a few % of lr;
    # everything else agrees far closer.
    assert 0.5 * LR < moved < 3 * LR
    assert max(beyond.values()) <= 0.1 * LR, max(beyond.items(), key=lambda kv: kv[1])
    assert rel_l2 <= 1e-3
    # Both stages step, and the tied embedding moved (its gradient is summed across stages).
    assert float((two[EMBED_KEY] - base[EMBED_KEY]).abs().max()) > 0.5 * LR
    last1, last2 = trained.runs[1][0]["metrics"], trained.runs[2][-1]["metrics"]
    assert len(last1) == len(last2) == STEPS
    for m1, m2 in zip(last1, last2, strict=True):
        assert m1["aggregate/contributors"] == m2["aggregate/contributors"] == len(CONTRIBUTORS)
        for key in ("train/loss", "train/grad_norm", "aggregate/contributor_grad_norm_max"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    for m0, m1 in zip(trained.runs[2][0]["metrics"], last2, strict=True):  # both stages
        assert (m0["train/loss"], m0["train/grad_norm"]) == (
            m1["train/loss"],
            m1["train/grad_norm"],
        )
    _report(
        "trainer",
        {
            **world.figures,
            "steps": STEPS,
            "lr": LR,
            "max_update": moved,
            "s1_vs_s2_max_abs_diff": diff[worst],
            "s1_vs_s2_worst_tensor": worst,
            "s1_vs_s2_max_beyond_rounding": max(beyond.values()),
            "s1_vs_s2_update_relative_l2": rel_l2,
            "s1_one_pass": trained.runs[1][0]["one_pass"],
            "s2_one_pass": trained.runs[2][0]["one_pass"],
            "grad_norm_s1": [m["train/grad_norm"] for m in last1],
            "grad_norm_s2": [m["train/grad_norm"] for m in last2],
            "train_s": {f"S{s}": round(r[0]["seconds"], 1) for s, r in trained.runs.items()},
            "spawn_wall_s": {f"S{s}": round(w, 1) for s, w in trained.wall_s.items()},
        },
    )


def _saved_state_of_model(model_dir: Path) -> dict[str, torch.Tensor]:
    state = _saved_state(model_dir)
    state.setdefault(LM_HEAD_KEY, state[EMBED_KEY])
    return state


# -- (b) publication with every codec


def _manifest(sealed: SignedManifest) -> PolicyManifest:
    return decode(PolicyManifest, sealed.manifest, max_bytes=len(sealed.manifest))


class _MemoryStore:
    def __init__(self) -> None:
        self.blobs: dict[bytes, bytes] = {}
        self.manifests: dict[int, SignedManifest] = {}

    def put_blob(self, data: bytes) -> bytes:
        from verify.manifest import blob_digest

        digest = blob_digest(data)
        self.blobs[digest] = data
        return digest

    def publish(self, sealed: SignedManifest) -> None:
        m = _manifest(sealed)
        self.manifests[m.version] = sealed


def _two_stages(model_dir: Path) -> list[Stage]:
    return [load_stage(model_dir, s, 2) for s in range(2)]


def _error_bound(codec: str, params: dict[str, Any], delta: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |rebuilt - trained| for one tensor's update ``delta`` (float32),
    from the codec's definition, plus two float32 roundings (forming and adding the delta)."""
    d = delta.reshape(-1).abs()
    rounding = torch.zeros_like(d)
    if codec == "fp32":
        return rounding
    if codec == "int8-block":
        block = params["block_size"]
        pad = (-d.numel()) % block
        absmax = torch.cat([d, d.new_zeros(pad)]).view(-1, block).amax(1)
        return (0.5 * absmax / 127 * BF16_SCALE_ROUNDING).repeat_interleave(block)[: d.numel()]
    # topk: a dropped element is off by itself; a kept one by half an int8 step of the
    # largest kept magnitude (exact when the values are sent as float32).
    half_step = 0.5 * float(d.max()) / 127 * BF16_SCALE_ROUNDING if params["int8"] else 0.0
    return torch.clamp(d, min=half_step)


def test_every_codec_publishes_a_verified_version(world: World, trained: Trained) -> None:
    base_stages = _two_stages(world.model)
    now = [dict(st.named_parameters()) for st in _two_stages(trained.dirs[2])]
    trained_state = {n: t.detach() for s in now for n, t in s.items() if n != LM_HEAD_KEY}
    base_state = {n: t.detach() for st in base_stages for n, t in st.named_parameters()}
    numel = sum(t.numel() for t in trained_state.values())
    figures: dict[str, Any] = {"parameters": numel, "bf16_bytes": 2 * numel}
    base_digest = model_dir_digest(world.model)
    for key, (name, params) in CODECS.items():
        pubs = [StagePublisher.for_stage(st, s, name, params) for s, st in enumerate(base_stages)]
        store = _MemoryStore()
        t0 = time.monotonic()
        sealed = publish_version(
            pubs,
            now,
            store,
            parent=None,
            base_digest=base_digest,
            trainer_key=TRAINER,
            now_ms=1_000,
        )
        encode_s = time.monotonic() - t0
        t0 = time.monotonic()
        sync = PolicySync(
            world.model, TRAINER.public, store.manifests.__getitem__, store.blobs.__getitem__, 2
        )
        rebuilt = sync.state_at(1)
        rebuild_s = time.monotonic() - t0
        published = {n: t for p in pubs for n, t in p.published_state().items()}
        worst, err_sq, upd_sq = 0.0, 0.0, 0.0
        for n, want in trained_state.items():
            got = rebuilt[n]
            assert torch.equal(got, published[n]), (key, n)  # the trainer's own copy, exactly
            delta = want - base_state[n]
            err = (got - want).reshape(-1).abs()
            bound = _error_bound(name, params, delta)
            bound += F32_EPS * (want.reshape(-1).abs() + delta.reshape(-1).abs())
            assert bool((err <= bound).all()), (key, n, float((err - bound).max()))
            worst = max(worst, float(err.max()))
            err_sq += float(err.double().square().sum())
            upd_sq += float(delta.double().square().sum())
        if name == "fp32":
            assert worst <= 2 * F32_EPS * max(float(t.abs().max()) for t in trained_state.values())
        nbytes = sum(s.nbytes for s in _manifest(sealed).shards)
        figures[key] = {
            "bytes": nbytes,
            "ratio_vs_bf16": round(2 * numel / nbytes, 2),
            "max_abs_error": worst,
            "relative_l2_error": math.sqrt(err_sq / upd_sq),
            "encode_s": round(encode_s, 1),
            "rebuild_s": round(rebuild_s, 1),
        }
        _refuses_tampering(world.model, store, sealed)
        del rebuilt, sync, pubs, store
    assert figures["topk-2%-int8"]["ratio_vs_bf16"] >= 10
    assert 1.8 < figures["int8-block"]["ratio_vs_bf16"] < 2.0
    _report("codecs", figures)


def _refuses_tampering(model: Path, store: _MemoryStore, sealed: SignedManifest) -> None:
    shard = _manifest(sealed).shards[0]
    blob = bytearray(store.blobs[shard.digest])
    blob[len(blob) // 2] ^= 0x01
    flipped = {**store.blobs, shard.digest: bytes(blob)}
    with pytest.raises(VerificationError) as err:
        PolicySync(
            model, TRAINER.public, store.manifests.__getitem__, flipped.__getitem__, 2
        ).state_at(1)
    assert err.value.reason is Reason.DIGEST_MISMATCH
    forged = seal(SigningKey.from_seed(b"\xee" * 32), _manifest(sealed))
    with pytest.raises(VerificationError) as err:
        PolicySync(
            model, TRAINER.public, {1: forged}.__getitem__, store.blobs.__getitem__, 2
        ).state_at(1)
    assert err.value.reason is Reason.BAD_SIGNATURE


# -- (c) release and `prooftrain release verify`


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_release_of_the_trained_version_verifies(
    world: World, trained: Trained, tmp_path: Path
) -> None:
    v = world.validator
    base_stages = _two_stages(world.model)
    name, params = CODECS[RELEASE_CODEC]
    pubs = [StagePublisher.for_stage(st, s, name, params) for s, st in enumerate(base_stages)]
    now = [dict(st.named_parameters()) for st in _two_stages(trained.dirs[2])]
    sealed = publish_version(
        pubs,
        now,
        LedgerSink(v),
        parent=None,
        base_digest=model_dir_digest(world.model),
        trainer_key=TRAINER,
        now_ms=1_000,
    )
    del base_stages, now, pubs
    # The trainer's eval of each version, recorded in the ledger (the release's curve).
    assert v.ledger.blobs is not None
    sync = PolicySync(world.model, TRAINER.public, {1: sealed}.__getitem__, v.ledger.blobs.get, 2)
    tokenizer = HFTextCodec(world.model)._tok  # noqa: SLF001
    for version, digest in ((0, b""), (1, manifest_digest(sealed))):
        report = evaluate(
            (cast(PreTrainedModel, sync.model_at(version)), tokenizer),
            TASK,
            "heldout",
            n=2,
            k=1,
            max_new_tokens=MAX_TOKENS,
            device="cpu",
        )
        v.record_eval(
            eval_statement(
                report,
                version=version,
                manifest_digest=digest,
                task=TASK,
                split="heldout",
                seed=0,
                key=TRAINER,
                created_at_ms=2_000 + version,
            )
        )
    v.ledger.checkpoint()
    out = tmp_path / "release"
    t0 = time.monotonic()
    build_release(
        ledger=world.ledger,
        out=out,
        base_model=world.model,
        trainer_key=TRAINER,
        eval_problems=1,  # the release's own table: 256-token greedy answers, the slow part
        k=1,
        tasks=[TASK],
        progress=False,
    )
    build_s = time.monotonic() - t0
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    keys = ["--trainer-key", TRAINER.public.hex(), "--validator-key", VALIDATOR.public.hex()]
    t0 = time.monotonic()
    ok = _cli("release", "verify", str(out), *keys)
    verify_s = time.monotonic() - t0
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert "ok: release of policy version 1" in ok.stdout
    # One weight changed in the released model: named, with both digests.
    weights = out / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    bad = _cli("release", "verify", str(out), *keys, "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    result = json.loads(bad.stdout)
    assert result["file"] == "model.safetensors" and result["reason"] == "digest_mismatch"
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*")}
    _report(
        "release",
        {
            "codec": RELEASE_CODEC,
            "release_bytes": size,
            "largest_files": dict(sorted(files.items(), key=lambda kv: -kv[1])[:4]),
            "build_s": round(build_s, 1),
            "verify_cli_s": round(verify_s, 1),
        },
    )


def test_samples_are_the_admitted_ones(world: World) -> None:
    """The trainer's input is the ledger's accepted samples, rewards aside."""
    served = world.validator.samples(0, 1_000).samples
    for a, b in zip(served, world.samples, strict=True):
        assert msgspec.structs.replace(a, reward=b.reward) == b
    assert {int(np.frombuffer(s.token_ids, "<u4").size) for s in served} <= set(
        range(1, MAX_TOKENS + 1)
    )
