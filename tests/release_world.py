"""A small but real training history for release tests.

A validator (ledger + blob store) over the demo base model when it is cached
(a tiny random model otherwise) admits honest groups, the trainer publishes
three versions of a two-stage pipeline (version 2 a full snapshot) through
``Validator.publish_policy``, and evaluates every version (0..3), recording
each eval with ``Validator.record_eval``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.tiny_model import build_tiny_model
from ledger.log import Ledger
from node.config import ValidatorConfig, load
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import StateStore
from rewards.tasks.base import generate
from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle
from rollout.sync import PolicySync
from rollout.worker import answer
from trainer.evals import eval_statement, evaluate
from trainer.publish import StagePublisher, publish_version
from trainer.stages import load_stage
from verify.keys import SigningKey
from verify.manifest import manifest_digest
from verify.spotcheck import FLOAT32_TOLERANCE
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


class _Sink:
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


def _train_step(stages: list, gen: torch.Generator) -> None:
    """A stand-in optimizer step: small noise; a tied copy gets its original's update."""
    with torch.no_grad():
        shared: dict[str, torch.Tensor] = {}
        for stage in stages:
            for name, p in stage.named_parameters():
                key = stage.tied_copies.get(name, name)
                if key not in shared:
                    shared[key] = 2e-3 * torch.randn(p.shape, generator=gen)
                p.add_(shared[key])


def build_world(root: Path) -> World:
    torch.set_num_threads(1)
    model = base_model(root)
    cfg = load(ValidatorConfig, None, {"assignment.max_tokens": 6, "assignment.group_size": 2,
                                       "audit.rate_override": 0.0, "audit.pit_min_tokens": 100_000})
    ledger_path = root / "ledger.sqlite"
    ledger = Ledger.open(ledger_path, signing_key=VALIDATOR, origin="test/release")
    codec = HFTextCodec(model)
    v = Validator(cfg, VALIDATOR, ledger, StateStore(root / "state.sqlite"), codec,
                  TransformersOracle({0: model}), generate("arithmetic", "train", 64),
                  PolicyVersions(model_dir_digest(model), TRAINER.public), FLOAT32_TOLERANCE)
    v.register(CONTRIBUTOR.public.raw, "c")
    backend = TransformersBackend(model)
    stages = [load_stage(model, s, STAGES) for s in range(STAGES)]
    pubs = [StagePublisher.for_stage(st, s, "int8-block", snapshot_every=2)
            for s, st in enumerate(stages)]
    sink, gen = _Sink(v), torch.Generator().manual_seed(0)
    manifests: list[SignedManifest] = []
    sync = PolicySync(model, TRAINER.public, lambda x: manifests[x - 1], sink.v.ledger.blobs.get,
                      STAGES)
    for version in range(VERSIONS + 1):
        if version:
            _groups(v, backend, codec, 2)
            _train_step(stages, gen)
            manifests.append(publish_version(
                pubs, [dict(st.named_parameters()) for st in stages], sink,
                parent=manifests[-1] if manifests else None, base_digest=model_dir_digest(model),
                trainer_key=TRAINER, now_ms=1_000 + version))
        tokenizer = codec._tok  # noqa: SLF001
        report = evaluate((sync.model_at(version), tokenizer), "arithmetic", "heldout", n=EVAL_N,
                          k=2, seed=0, device="cpu")
        digest = manifest_digest(manifests[-1]) if version else b""
        v.record_eval(eval_statement(report, version=version, manifest_digest=digest,
                                     task="arithmetic", split="heldout", seed=0, key=TRAINER,
                                     created_at_ms=2_000 + version))
    _groups(v, backend, codec, 1)  # after the last publication: not part of the release
    v.ledger.checkpoint()
    return World(model, ledger_path, v, manifests)
