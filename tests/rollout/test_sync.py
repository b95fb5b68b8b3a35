"""Contributor-side reconstruction: bit-identical to the trainer's published copy, verified first."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollout import sync as sync_mod
from rollout.sync import PolicySync, base_model_digest, layer_stages
from tests.release_world import tiny_llama, tiny_llama_fixtures
from tests.trainer.test_publish import TRAINER, run_chain
from trainer.publish import LocalPolicyStore
from trainer.stages import partition_layers
from verify.errors import Reason, VerificationError
from verify.keys import SigningKey
from verify.types import PolicyManifest, SignedManifest, decode

REPO = Path(__file__).resolve().parents[2]


untied, tied = tiny_llama_fixtures()


def make_sync(model_dir: Path, store: LocalPolicyStore, num_stages: int, **kw) -> PolicySync:
    return PolicySync(
        model_dir,
        kw.pop("key", TRAINER.public),
        kw.pop("fm", store.manifest),
        kw.pop("fb", store.blob),
        num_stages,
        **kw,
    )


def trainer_state(pubs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in pubs:
        out.update(p.published_state())
    return out


def assert_same(rebuilt: dict[str, torch.Tensor], published: dict[str, torch.Tensor]) -> None:
    for name, value in rebuilt.items():
        assert torch.equal(value, published[name]), name
    # Every published tensor arrives; a tied lm_head copy equals the embedding it follows.
    for name, value in published.items():
        assert torch.equal(value, rebuilt.get(name, rebuilt["model.embed_tokens.weight"])), name


@pytest.mark.parametrize(
    ("fixture", "num_stages", "codec"),
    [("untied", 1, "topk"), ("untied", 2, "int8"), ("tied", 2, "topk"), ("tied", 1, "fp32")],
)
def test_rebuild_equals_published_copy(
    request, tmp_path: Path, fixture: str, num_stages: int, codec: str
) -> None:
    model_dir = request.getfixturevalue(fixture)
    _, pubs, sealed = run_chain(model_dir, tmp_path, num_stages=num_stages, versions=6, codec=codec)
    sync = make_sync(model_dir, LocalPolicyStore(tmp_path), num_stages)
    rebuilt = sync.state_at(6)
    assert_same(rebuilt, trainer_state(pubs))
    assert not torch.equal(rebuilt["model.norm.weight"], sync.state_at(0)["model.norm.weight"])
    model = sync.model_at(6)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), rebuilt[name])
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_rebuild_in_another_process_is_identical(untied: Path, tmp_path: Path) -> None:
    """A second interpreter re-runs the trainer and rebuilds our chain: same bytes, same weights."""
    _, pubs, sealed = run_chain(untied, tmp_path / "here", num_stages=2, versions=5)
    script = textwrap.dedent(f"""
        import hashlib, json, torch
        from pathlib import Path
        from tests.trainer.test_publish import TRAINER, run_chain
        from trainer.publish import LocalPolicyStore
        from rollout.sync import PolicySync
        torch.set_num_threads(1)
        model, here = Path({str(untied)!r}), Path({str(tmp_path / "here")!r})
        _, pubs, sealed = run_chain(model, here.parent / "there", num_stages=2, versions=5)
        store = LocalPolicyStore(here)
        state = PolicySync(model, TRAINER.public, store.manifest, store.blob, 2).state_at(5)
        h = hashlib.sha256()
        for name in sorted(state):
            h.update(name.encode() + state[name].numpy().tobytes())
        print(json.dumps({{"manifests": [s.manifest.hex() for s in sealed],
                          "sha": h.hexdigest()}}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["manifests"] == [s.manifest.hex() for s in sealed]  # same digests and sizes
    import hashlib

    h = hashlib.sha256()
    state = trainer_state(pubs)
    for name in sorted(state):
        h.update(name.encode() + state[name].numpy().tobytes())
    assert child["sha"] == h.hexdigest()


def test_snapshots_bound_the_chain(untied: Path, tmp_path: Path) -> None:
    stages, pubs, sealed = run_chain(untied, tmp_path, num_stages=2, versions=7, snapshot_every=3)
    store = LocalPolicyStore(tmp_path)
    kinds = [decode(PolicyManifest, s.manifest, max_bytes=10_000).shards[0].kind for s in sealed]
    assert kinds == ["delta", "delta", "full", "delta", "delta", "full", "delta"]
    asked: list[int] = []

    def fetch(version: int) -> SignedManifest:
        asked.append(version)
        return store.manifest(version)

    jumper = make_sync(untied, store, 2, fm=fetch)
    direct = jumper.state_at(7)
    assert min(asked) == 6  # nothing before the latest snapshot is needed
    follower = make_sync(untied, store, 2)
    for v in range(1, 8):  # one version at a time, through the cache
        stepped = follower.state_at(v)
    assert_same(direct, trainer_state(pubs))
    assert_same(stepped, trainer_state(pubs))


@pytest.fixture
def published(untied: Path, tmp_path: Path):
    run_chain(untied, tmp_path, num_stages=2, versions=3)
    return untied, LocalPolicyStore(tmp_path)


@pytest.fixture
def no_decode(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    monkeypatch.setattr(sync_mod, "apply_state_delta", lambda *a, **k: calls.append(a))
    return calls


def _refused(sync: PolicySync, version: int) -> Reason:
    with pytest.raises(VerificationError) as err:
        sync.state_at(version)
    return err.value.reason


def test_tampered_blob_is_refused_before_decoding(published, no_decode) -> None:
    model_dir, store = published

    def flipped(digest: bytes) -> bytes:
        data = bytearray(store.blob(digest))
        data[len(data) // 2] ^= 1
        return bytes(data)

    assert _refused(make_sync(model_dir, store, 2, fb=flipped), 3) is Reason.DIGEST_MISMATCH
    short = make_sync(model_dir, store, 2, fb=lambda d: store.blob(d)[:-1])
    assert _refused(short, 3) is Reason.DIGEST_MISMATCH
    assert no_decode == []


def test_tampered_manifest_and_wrong_key_are_refused(published, no_decode) -> None:
    model_dir, store = published

    def tampered(version: int) -> SignedManifest:
        sealed = store.manifest(version)
        body = bytearray(sealed.manifest)
        body[-1] ^= 1
        return SignedManifest(manifest=bytes(body), signature=sealed.signature)

    assert _refused(make_sync(model_dir, store, 2, fm=tampered), 3) is Reason.BAD_SIGNATURE
    other = SigningKey.from_seed(b"\x99" * 32).public
    assert _refused(make_sync(model_dir, store, 2, key=other), 2) is Reason.BAD_SIGNATURE
    wrong_version = make_sync(model_dir, store, 2, fm=lambda v: store.manifest(1))
    assert _refused(wrong_version, 2) is Reason.WRONG_MANIFEST
    assert _refused(make_sync(model_dir, store, 1), 2) is Reason.INCONSISTENT
    assert no_decode == []


def test_broken_parent_link_and_other_base_are_refused(
    published, tmp_path: Path, no_decode
) -> None:
    model_dir, store = published
    m3 = decode(PolicyManifest, store.manifest(3).manifest, max_bytes=10_000)
    # A trainer-signed version 3 whose parent is not the published version 2.
    bad_parent = _with_parent(m3, b"\x07" * 32)
    fm = lambda v: bad_parent if v == 3 else store.manifest(v)  # noqa: E731
    assert _refused(make_sync(model_dir, store, 2, fm=fm), 3) is Reason.WRONG_MANIFEST
    other_base = tiny_llama(tmp_path / "other", tied=False, seed=5)
    assert base_model_digest(other_base) != base_model_digest(model_dir)
    assert _refused(make_sync(other_base, store, 2), 2) is Reason.WRONG_MANIFEST
    assert no_decode == []


def _with_parent(m: PolicyManifest, parent: bytes) -> SignedManifest:
    from verify.signed import seal

    return seal(
        TRAINER,
        PolicyManifest(
            m.schema_version,
            m.version,
            parent,
            m.base_digest,
            m.shards,
            m.trainer_key,
            m.created_at_ms,
        ),
    )


def test_stage_split_matches_trainer_and_validator(untied: Path) -> None:
    from node.validator.policy import model_dir_digest

    assert base_model_digest(untied) == model_dir_digest(untied)
    assert layer_stages(10, 4) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    for layers in range(1, 9):
        for stages in range(1, layers + 1):
            got = layer_stages(layers, stages)
            assert got == sorted(got) and set(got) == set(range(stages))
            assert [list(s.layers) for s in partition_layers(layers, stages)] == [
                [i for i, s in enumerate(got) if s == stage] for stage in range(stages)
            ]


def test_rebuilt_model_drives_backend_and_oracle(published) -> None:
    from rollout.backends import GenerationRequest, TransformersBackend
    from rollout.oracle import TransformersOracle

    model_dir, store = published
    sync = make_sync(model_dir, store, 2)
    oracle = TransformersOracle(sync.model_at)
    backend = TransformersBackend(sync.model_at(3))
    prompt = (1, 5, 6)
    req = GenerationRequest(
        prompt_ids=prompt,
        group_size=2,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_tokens=4,
        sampler_key=b"\x01" * 32,
        nonce=b"\x02" * 16,
        seed=7,
    )
    for out in backend.generate(req):
        ids = list(prompt) + list(out.token_ids)
        again = oracle.logprobs(3, ids, len(prompt), 1.0, 0, 1.0)
        assert again == pytest.approx(out.logprobs, abs=1e-4)
        base = oracle.logprobs(0, ids, len(prompt), 1.0, 0, 1.0)
        assert base != pytest.approx(out.logprobs, abs=1e-4)


def test_broken_link_after_a_cached_version_is_refused(published, monkeypatch) -> None:
    model_dir, store = published
    m3 = decode(PolicyManifest, store.manifest(3).manifest, max_bytes=10_000)
    bad_parent = _with_parent(m3, b"\x07" * 32)
    sync = make_sync(model_dir, store, 2, fm=lambda v: bad_parent if v == 3 else store.manifest(v))
    sync.state_at(2)  # verified and cached: the anchor for version 3
    calls: list = []
    monkeypatch.setattr(sync_mod, "apply_state_delta", lambda *a, **k: calls.append(a))
    assert _refused(sync, 3) is Reason.WRONG_MANIFEST
    assert calls == []
