"""Rebuilding the published copy from a chain of signed updates, as a trainer without its
checkpoint does: bit for bit the trainer's own copy, and every failed check names its version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.sync import base_model_digest
from tests.release_world import tiny_llama_fixtures
from tests.trainer.test_publish import TRAINER, run_chain
from trainer.chain_resume import ChainError, rebuild_published
from trainer.publish import LocalPolicyStore, publishable_state
from trainer.stages import load_stage
from verify.errors import Reason, VerificationError
from verify.keys import SigningKey

untied, _ = tiny_llama_fixtures()


@pytest.fixture(scope="module")
def chain(untied: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    store_dir = tmp_path_factory.mktemp("chain")
    _, pubs, sealed = run_chain(
        untied, store_dir, num_stages=1, versions=5, codec="int8", snapshot_every=3
    )
    base = {n: t.clone() for n, t in publishable_state(load_stage(untied, 0, 1)).items()}
    return untied, LocalPolicyStore(store_dir), pubs[0], sealed, base


def _rebuild(chain, version: int = 5, **changes):  # type: ignore[no-untyped-def]
    model, store, _, _, base = chain
    args = {
        "base_digest": base_model_digest(model),
        "trainer": TRAINER.public,
        "fetch_manifest": store.manifest,
        "fetch_blob": store.blob,
        **changes,
    }
    return rebuild_published(version, base, **args)


def test_rebuilt_weights_are_the_publishers_copy_bit_for_bit(chain) -> None:  # type: ignore[no-untyped-def]
    _, _, publisher, sealed, _ = chain
    state, last = _rebuild(chain)
    assert last == sealed[-1]
    copy = publisher.published_state()
    assert state.keys() == copy.keys()
    for name, value in copy.items():
        assert torch.equal(state[name], value), name


def test_a_corrupt_blob_names_its_version(chain) -> None:  # type: ignore[no-untyped-def]
    _, store, _, sealed, _ = chain
    from verify.types import PolicyManifest, decode

    bad = decode(PolicyManifest, sealed[3].manifest, max_bytes=10**6).shards[0].digest

    def fetch_blob(digest: bytes) -> bytes:
        data = store.blob(digest)
        return data[:-1] + bytes([data[-1] ^ 1]) if digest == bad else data

    with pytest.raises(ChainError, match="policy version 4") as info:
        _rebuild(chain, fetch_blob=fetch_blob)
    assert isinstance(info.value.cause, VerificationError)
    assert info.value.cause.reason is Reason.DIGEST_MISMATCH


def test_another_trainer_key_another_base_or_a_missing_manifest_is_refused(chain) -> None:  # type: ignore[no-untyped-def]
    _, store, _, sealed, _ = chain
    with pytest.raises(ChainError, match="policy version 1"):
        _rebuild(chain, trainer=SigningKey.from_seed(b"\x07" * 32).public)
    with pytest.raises(ChainError, match="policy version 1.*another base model"):
        _rebuild(chain, base_digest=b"\x00" * 32)

    def missing_third(version: int):  # type: ignore[no-untyped-def]
        if version == 3:
            raise VerificationError("no manifest", reason=Reason.NOT_FOUND)
        return store.manifest(version)

    with pytest.raises(ChainError, match="policy version 3"):
        _rebuild(chain, fetch_manifest=missing_third)
    with pytest.raises(ChainError, match="policy version 4"):
        _rebuild(chain, fetch_manifest=lambda v: sealed[2] if v == 4 else store.manifest(v))
