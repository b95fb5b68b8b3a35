"""A small but real training history for release tests, and the tiny models and stand-in
training step that publication tests share.

A validator (ledger + blob store) over the demo base model when it is cached
(a tiny random model otherwise) admits honest groups, the trainer publishes
three versions of a two-stage pipeline (version 2 a full snapshot) through
``Validator.publish_policy``, and evaluates every version (0..3), recording
each eval with ``Validator.record_eval``.

Fixture factories: a test module writes ``world, release = release_fixtures(n)`` or
``untied, tied = tiny_llama_fixtures()`` to get those module-scoped fixtures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.tiny_model import build_tiny_model
from ledger.log import Ledger
from node.config import ValidatorConfig, load
from node.validator.build import load_tolerance
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import StateStore
from rewards import Problem
from rewards.tasks.base import generate
from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle
from rollout.sync import PolicySync
from rollout.worker import answer
from trainer.evals import eval_statement, evaluate
from trainer.publish import StagePublisher, publish_version
from trainer.release import build_release
from trainer.stages import Stage, load_stage
from verify.keys import SigningKey
from verify.manifest import manifest_digest
from verify.spotcheck import FLOAT32_TOLERANCE, Tolerance
from verify.types import SignedManifest, canonical_bytes

TRAINER = SigningKey.from_seed(b"\x91" * 32)
VALIDATOR = SigningKey.from_seed(b"\x92" * 32)
CONTRIBUTOR = SigningKey.from_seed(b"\x93" * 32)
VERSIONS = 3
STAGES = 2
EVAL_N = 4


@dataclass
class World:
    model: Path
    ledger: Path
    validator: Validator
    manifests: list[SignedManifest]


def base_model(root: Path) -> Path:
    from trainer.base_model import BUILD_INFO, BaseModelConfig, cache_path

    path = cache_path(BaseModelConfig(task="arithmetic"), 0)
    if (path / BUILD_INFO).is_file():
        return path
    return build_tiny_model(root / "tiny-model")


class LedgerSink:
    """Publication into a validator's ledger (blobs, then the signed manifest)."""

    def __init__(self, v: Validator) -> None:
        self.v = v

    def put_blob(self, data: bytes) -> bytes:
        assert self.v.ledger.blobs is not None
        return self.v.ledger.blobs.put(data)

    def publish(self, sealed: SignedManifest) -> int:
        return self.v.publish_policy(sealed)


def _groups(v: Validator, backend: TransformersBackend, codec: HFTextCodec, n: int) -> None:
    for _ in range(n):
        group = answer(CONTRIBUTOR, v.assign(CONTRIBUTOR.public.raw), v.key.public, backend, codec)
        v.submit(canonical_bytes(group))


def tiny_llama(path: Path, *, tied: bool, layers: int = 2, seed: int = 0) -> Path:
    """A random Llama of about 40k parameters with the character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_llama_fixtures() -> tuple[Any, Any]:
    """Module-scoped fixtures ``untied`` (2 layers) and ``tied`` (3 layers, tied embeddings)."""

    @pytest.fixture(scope="module")
    def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tiny_llama(tmp_path_factory.mktemp("untied"), tied=False)

    @pytest.fixture(scope="module")
    def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tiny_llama(tmp_path_factory.mktemp("tied"), tied=True, layers=3)

    return untied, tied


def train_step(stages: list[Stage], gen: torch.Generator, lr: float = 1e-3) -> None:
    """A stand-in optimizer step: noise on every parameter; tied copies get the same update."""
    with torch.no_grad():
        shared: dict[str, torch.Tensor] = {}
        for stage in stages:
            for name, p in stage.named_parameters():
                key = stage.tied_copies.get(name, name)
                if key not in shared:
                    shared[key] = lr * torch.randn(p.shape, generator=gen)
                p.add_(shared[key])


def make_validator(
    root: Path,
    model: Path,
    settings: dict[str, Any],
    *,
    pool: list[Problem],
    origin: str,
    tolerance: Tolerance | None = None,
) -> Validator:
    """A validator over ``model`` with its ledger (``root/ledger.sqlite``) and state in
    ``root``, the trainer key ``TRAINER``, ``settings`` over the defaults (no PIT test on
    these short runs) and ``tolerance`` (default: the config's)."""
    cfg = load(ValidatorConfig, None, {"audit.pit_min_tokens": 100_000, **settings})
    ledger = Ledger.open(root / "ledger.sqlite", signing_key=VALIDATOR, origin=origin)
    return Validator(
        cfg,
        VALIDATOR,
        ledger,
        StateStore(root / "state.sqlite"),
        HFTextCodec(model),
        TransformersOracle({0: model}),
        pool,
        PolicyVersions(model_dir_digest(model), TRAINER.public),
        load_tolerance(cfg) if tolerance is None else tolerance,
    )


def build_world(root: Path) -> World:
    torch.set_num_threads(1)
    model = base_model(root)
    v = make_validator(
        root,
        model,
        {"assignment.max_tokens": 6, "assignment.group_size": 2, "rules.audit_rate": 0.0},
        pool=generate("arithmetic", "train", 64),
        origin="test/release",
        tolerance=FLOAT32_TOLERANCE,
    )
    ledger_path, codec = root / "ledger.sqlite", HFTextCodec(model)
    v.register(CONTRIBUTOR.public.raw, "c")
    backend = TransformersBackend(model)
    stages = [load_stage(model, s, STAGES) for s in range(STAGES)]
    pubs = [
        StagePublisher.for_stage(st, s, "int8-block", snapshot_every=2)
        for s, st in enumerate(stages)
    ]
    sink, gen = LedgerSink(v), torch.Generator().manual_seed(0)
    manifests: list[SignedManifest] = []
    sync = PolicySync(
        model, TRAINER.public, lambda x: manifests[x - 1], sink.v.ledger.blobs.get, STAGES
    )
    for version in range(VERSIONS + 1):
        if version:
            _groups(v, backend, codec, 2)
            train_step(stages, gen, lr=2e-3)
            manifests.append(
                publish_version(
                    pubs,
                    [dict(st.named_parameters()) for st in stages],
                    sink,
                    parent=manifests[-1] if manifests else None,
                    base_digest=model_dir_digest(model),
                    trainer_key=TRAINER,
                    now_ms=1_000 + version,
                )
            )
        tokenizer = codec._tok  # noqa: SLF001
        report = evaluate(
            (sync.model_at(version), tokenizer),
            "arithmetic",
            "heldout",
            n=EVAL_N,
            k=2,
            seed=0,
            device="cpu",
        )
        digest = manifest_digest(manifests[-1]) if version else b""
        v.record_eval(
            eval_statement(
                report,
                version=version,
                manifest_digest=digest,
                task="arithmetic",
                split="heldout",
                seed=0,
                key=TRAINER,
                created_at_ms=2_000 + version,
            )
        )
    _groups(v, backend, codec, 1)  # after the last publication: not part of the release
    v.ledger.checkpoint()
    return World(model, ledger_path, v, manifests)


def release_fixtures(eval_problems: int) -> tuple[Any, Any]:
    """Module-scoped fixtures ``world`` (built once per test module) and ``release`` (its
    release directory, ``eval_problems`` problems per eval, pass@k up to k = 2)."""

    @pytest.fixture(scope="module")
    def world(tmp_path_factory: pytest.TempPathFactory) -> World:
        return build_world(tmp_path_factory.mktemp("world"))

    @pytest.fixture(scope="module")
    def release(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return build_release(
            ledger=world.ledger,
            out=tmp_path_factory.mktemp("r") / "release",
            base_model=world.model,
            trainer_key=TRAINER,
            eval_problems=eval_problems,
            k=2,
            progress=False,
        )

    return world, release
