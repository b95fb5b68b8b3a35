"""An in-process network: one validator core, N contributors, a policy-version registry.

Everything a real run does except sockets: contributors answer signed
assignments (honestly, or with a strategy from ``harness.adversaries``), the
validator core admits, scores, spot-checks and records them in its ledger, and
accepted samples are served by cursor (``fetch``, a ``trainer.buffer.SampleSource``).

Policy versions: ``publish(version, stage)`` encodes the new weights as one
compressed update (``trainer.publish.StagePublisher``: the configured codec with
error feedback, a full snapshot every ``snapshot_every`` versions), puts the
blob in the ledger's blob store, signs the manifest with the network's trainer
key and records it with the validator, so assignments from then on name the
new version and spot checks recompute under it. The registry (bounded to the
staleness window) holds the *published copy*, the weights every contributor
rebuilds from the chain (``rollout.sync.PolicySync``), not the trainer's own:
contributors sample from it, spot checks recompute under it and evals score it.
``publish_delay = s`` holds each version back for s further publications: the
validator then assigns version v - s while the trainer is at v, which is how
benchmarks emulate staleness s with every sample still verified.

``fetch`` produces ``groups_per_fetch`` new groups when the stream has nothing
past ``cursor`` (``auto_produce``), so a trainer loop can pull from it directly.
"""

from __future__ import annotations

import copy
import itertools
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from harness.adversaries.base import Context, make_strategy
from ledger.log import Ledger
from node.config import ValidatorConfig, load
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import StateStore
from rewards.tasks.base import generate as generate_problems
from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle, UnknownPolicyVersion
from rollout.sync import PolicySync
from rollout.worker import answer
from trainer.base_model import ensure_base_model
from trainer.config import TrainerConfig
from trainer.evals import EvalReport, eval_statement, evaluate
from trainer.launch import init_distributed
from trainer.loop import History, TrainerLoop, ensure_process_group
from trainer.losses import Metrics
from trainer.pipeline import PipelineRunner
from trainer.publish import StagePublisher, build_manifest
from trainer.stages import load_stage
from verify.errors import AdmissionError, ConfigError
from verify.keys import SigningKey
from verify.signed import open_sealed
from verify.spotcheck import FLOAT32_TOLERANCE
from verify.types import SampleBatch, SignedManifest, Verdict, canonical_bytes, decode


def simulation_entropy(seed: int, opened_at: int) -> Callable[[int], bytes]:
    """The in-process validator's randomness (assignment ids, nonces, sampling seeds, epoch
    secrets) as a blake3 stream of ``seed``, so a run repeats with its seed.

    A simulation holds no secrets, as with its keys. ``opened_at`` (the ledger's size
    when the network opens) separates a reopened network's stream from the first one's,
    so a resumed run never reissues an assignment id or nonce.
    """
    stream = blake3.blake3(f"local-entropy/{seed}/{opened_at}".encode())
    position = 0
    lock = threading.Lock()

    def entropy(n: int) -> bytes:
        nonlocal position
        with lock:
            out = stream.digest(length=n, seek=position)
            position += n
        return out

    return entropy


def local_trainer_key() -> SigningKey:
    """The in-process network's trainer key (deterministic: simulations are not secrets)."""
    return SigningKey.from_seed(blake3.blake3(b"local-trainer").digest())


def local_validator_key() -> SigningKey:
    """The in-process network's validator (ledger) key, deterministic like the trainer's."""
    return SigningKey.from_seed(blake3.blake3(b"local-validator").digest())


class VersionRegistry:
    """Policy version -> model, keeping only the newest ``keep`` versions (and 0 never)."""

    def __init__(self, base: PreTrainedModel, keep: int) -> None:
        self.keep = max(1, keep)
        self._models: dict[int, PreTrainedModel] = {0: base}

    def __getitem__(self, version: int) -> PreTrainedModel:
        try:
            return self._models[version]
        except KeyError:
            raise UnknownPolicyVersion(f"no weights for policy version {version}") from None

    def __contains__(self, version: int) -> bool:
        return version in self._models

    @property
    def newest(self) -> int:
        return max(self._models)

    def add(self, version: int, model: PreTrainedModel) -> None:
        self._models[version] = model.eval()
        for v in sorted(self._models):
            if 0 < v <= version - self.keep:
                del self._models[v]


class RegistryOracle(TransformersOracle):
    """The spot-check oracle over the registry (no per-version cache to grow)."""

    def __init__(self, registry: VersionRegistry) -> None:
        super().__init__({})
        self.registry = registry

    def model(self, version: int) -> torch.nn.Module:
        return self.registry[version]


@dataclass(frozen=True)
class LocalSettings:
    """What the in-process network is made of."""

    contributors: int = 4
    adversaries: tuple[str, ...] = ()
    """Strategy names (``harness.adversaries``), one extra contributor each."""
    group_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    pool: int = 8192
    task: str = "arithmetic"
    seed: int = 0
    audit_rate: float = -1.0
    """-1: the reputation-driven rate; otherwise a fixed spot-check rate."""
    max_staleness: int = 16
    """The validator's admission staleness window."""
    groups_per_fetch: int = 16
    publish_delay: int = 0
    codec: str = "int8-block"
    """Codec of each published update (``verify.weights_codec.CODECS``)."""
    codec_params: tuple[tuple[str, object], ...] = ()
    snapshot_every: int = 50
    """Every N-th version is a full snapshot; 0 never."""


@dataclass
class Stats:
    submitted: int = 0
    admission_errors: Counter[str] = field(default_factory=Counter)
    verdicts: Counter[str] = field(default_factory=Counter)
    audited: int = 0


class LocalNetwork:
    """See the module docstring. ``close()`` releases the ledger and state files."""

    def __init__(
        self, model_dir: str | Path, settings: LocalSettings = LocalSettings(), *,
        work_dir: str | Path | None = None,
    ) -> None:
        self.settings = s = settings
        self.model_dir = Path(model_dir)
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="prooftrain-local-")
        self.work_dir = Path(work_dir or self._tmp.name)  # type: ignore[union-attr]
        self.work_dir.mkdir(parents=True, exist_ok=True)
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.registry = VersionRegistry(base.eval(), keep=s.max_staleness + s.publish_delay + 2)
        self.codec = HFTextCodec(self.model_dir)
        self.trainer_key = local_trainer_key()
        vkey = local_validator_key()
        cfg = load(ValidatorConfig, None, {
            "assignment.group_size": s.group_size, "assignment.max_tokens": s.max_tokens,
            "assignment.temperature": s.temperature, "audit.rate_override": s.audit_rate,
            "policy.max_staleness": s.max_staleness + s.publish_delay,
            "audit.epoch_groups": 64, "node.checkpoint_every": 256,
        })
        self.ledger = Ledger.open(self.work_dir / "ledger.sqlite", signing_key=vkey,
                                  origin="prooftrain/local")
        self.state = StateStore(self.work_dir / "state.sqlite")
        self.versions = PolicyVersions(model_dir_digest(self.model_dir), self.trainer_key.public)
        problems = generate_problems(s.task, "train", s.pool, seed=s.seed)
        self.validator = Validator(cfg, vkey, self.ledger, self.state, self.codec,
                                   RegistryOracle(self.registry), problems, self.versions,
                                   FLOAT32_TOLERANCE,
                                   entropy=simulation_entropy(s.seed, self.ledger.size()))
        names = ["honest"] * s.contributors + list(s.adversaries)
        self.contributors: list[tuple[SigningKey, str]] = []
        for i, name in enumerate(names):
            key = SigningKey.from_seed(blake3.blake3(f"local-contributor/{i}".encode()).digest())
            self.validator.register(key.public.raw, f"{name}-{i}")
            self.contributors.append((key, name))
        self._turn = itertools.cycle(range(len(self.contributors)))
        self._held: list[tuple[int, PreTrainedModel, SignedManifest]] = []  # not yet announced
        self.publisher = StagePublisher.for_stage(base, 0, s.codec, dict(s.codec_params),
                                                  s.snapshot_every)
        self._parent: SignedManifest | None = None
        self._pending_evals: list[tuple[int, EvalReport, int]] = []
        self.stats = Stats()
        current = self.versions.current  # > 0 when reopening a network's work_dir
        if current:
            self._restore_publisher(current)

    def close(self) -> None:
        self.ledger.close()
        self.state.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- rollouts

    def _submit_one(self, index: int) -> None:
        key, name = self.contributors[index]
        try:
            sealed = self.validator.assign(key.public.raw)
            version = self.validator.open_assignment(sealed).policy_version
            backend = TransformersBackend(self.registry[version])
            if name == "honest":
                group = answer(key, sealed, self.validator.key.public, backend, self.codec)
                body = canonical_bytes(group)
            else:
                ctx = Context(key, backend, self.codec, self.validator.key.public,
                              oracle=RegistryOracle(self.registry))
                body = make_strategy(name).answer(ctx, sealed)
            verdicts = self.validator.submit(body)
        except AdmissionError as exc:
            self.stats.admission_errors[exc.reason.value if exc.reason else "?"] += 1
            return
        self.stats.submitted += 1
        for sv in verdicts:
            v = open_sealed(Verdict, sv, self.validator.key.public)
            self.stats.verdicts["accepted" if v.accepted else v.reason] += 1
            self.stats.audited += int(v.audited)

    def step(self, groups: int) -> None:
        """Have the contributors answer ``groups`` assignments, round-robin."""
        for _ in range(groups):
            self._submit_one(next(self._turn))

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        """``trainer.buffer.SampleSource``: accepted samples from ledger index ``cursor``."""
        batch = self.validator.samples(cursor, limit)
        if not batch.samples and self.settings.groups_per_fetch > 0:
            self.step(self.settings.groups_per_fetch)
            batch = self.validator.samples(cursor, limit)
        return batch

    # -- policy versions

    def publish(self, version: int, stage: torch.nn.Module) -> None:
        """Trainer hook: publish ``version`` from a whole-model stage."""
        self.publish_state(version, stage.state_dict())

    def publish_state(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Publish ``version`` from a full state dict under Hugging Face names.

        The update is encoded, stored and signed now; the validator hears of it
        after ``publish_delay`` further publications.
        """
        if version != self.publisher.version + 1:
            raise ConfigError(f"the network has published version {self.publisher.version}; "
                              f"cannot publish {version}")
        update = self.publisher.update(state)
        assert self.ledger.blobs is not None
        self.ledger.blobs.put(update.blob)
        sealed = build_manifest(version, self._parent, self.versions.base_digest, [update],
                                self.publisher.codec_name, self.trainer_key, self.validator.clock())
        self._parent = sealed
        self._held.append((version, self._published_model(), sealed))
        while len(self._held) > self.settings.publish_delay:
            v, m, manifest = self._held.pop(0)
            self.registry.add(v, m)
            self.validator.publish_policy(manifest)
        self._record_pending_evals()

    def record_eval(self, version: int, report: EvalReport, *, seed: int) -> None:
        """Sign the trainer's evaluation of ``version`` and record it in the ledger.

        A version still held back (``publish_delay``) is recorded when it is announced.
        """
        self._pending_evals.append((version, report, seed))
        self._record_pending_evals()

    def _record_pending_evals(self) -> None:
        current = self.validator.versions.current
        while self._pending_evals and self._pending_evals[0][0] <= current:
            version, report, seed = self._pending_evals.pop(0)
            digest = self.versions.digest(version) if version else b""
            self.validator.record_eval(eval_statement(
                report, version=version, manifest_digest=digest or b"", task=report.task,
                split=report.split, seed=seed, key=self.trainer_key,
                created_at_ms=self.validator.clock()))

    def _published_model(self) -> PreTrainedModel:
        model = copy.deepcopy(self.registry[0])
        self.publisher.load_into(model)
        return model.eval()

    def model(self, version: int) -> PreTrainedModel:
        """The published weights of ``version``, announced or still held back."""
        for v, m, _ in self._held:
            if v == version:
                return m
        return self.registry[version]

    def manifest(self, version: int) -> SignedManifest:
        """The signed manifest of an announced ``version`` (as the validator recorded it)."""
        raw = self.state.manifest(version)
        if raw is None:
            raise UnknownPolicyVersion(f"policy version {version} was never announced")
        return decode(SignedManifest, raw, max_bytes=len(raw))

    def adopt(self, version: int, stage: torch.nn.Module) -> None:
        """After a trainer resume at ``version``: continue the published chain from there."""
        self.adopt_state(version, stage.state_dict())

    def adopt_state(self, version: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """Resume publication at ``version``, which the validator must hold as current.

        The published copy is rebuilt from the ledger's own chain of signed
        manifests and blobs (every signature and digest checked), so the next
        update continues exactly what contributors hold; the trainer's weights
        (``state``) only need to be of the same model.
        """
        current = self.validator.versions.current
        if current != version:
            raise ConfigError(
                f"the network's validator is at policy version {current} but the checkpoint "
                f"is at {version}; resume needs a checkpoint of the last published version"
            )
        if self.publisher.version != version:
            self._restore_publisher(version)

    def _restore_publisher(self, version: int) -> None:
        blobs = self.ledger.blobs
        assert blobs is not None
        sync = PolicySync(self.model_dir, self.trainer_key.public, self.manifest, blobs.get, 1)
        rebuilt = sync.state_at(version)
        own = self.publisher.published_state()
        self.publisher.load_state({
            "version": version, "own": {n: rebuilt[n] for n in own}, "mirror": {},
            "residual": {},
        })
        self._parent = self.manifest(version) if version else None
        if version:
            self.registry.add(version, self._published_model())

    def weight(self, contributor: bytes) -> float:
        """Reputation score in (0, 1): a contributor weight for robust aggregation."""
        return self.ledger.reputation(contributor).score

    def weights(self, contributors: Sequence[bytes]) -> torch.Tensor:
        return torch.tensor([self.weight(c) for c in contributors], dtype=torch.float64)



def settings_from(cfg: TrainerConfig) -> LocalSettings:
    c = cfg.local
    return LocalSettings(
        contributors=c.contributors, adversaries=tuple(c.adversaries), group_size=c.group_size,
        max_tokens=c.max_tokens, temperature=c.temperature, pool=c.pool, task=cfg.task,
        seed=cfg.seed, audit_rate=c.audit_rate, max_staleness=cfg.max_staleness,
        groups_per_fetch=c.groups_per_fetch, codec=cfg.publish.codec,
        codec_params=tuple(sorted(cfg.publish.codec_params.items())),
        snapshot_every=cfg.publish.snapshot_every,
    )


def run_local(
    cfg: TrainerConfig, *, network: LocalNetwork | None = None, progress: bool = True,
    on_metrics: Callable[[int, Metrics], None] | None = None, resume: bool = False,
) -> tuple[History, LocalNetwork]:
    """Train a one-stage policy against an in-process network; returns the history and network.

    Evaluates held-out greedy pass@1 at version 0, every ``eval_every`` steps and at the end.
    The caller closes the returned network.
    """
    if cfg.stages != 1:
        raise ConfigError("the in-process network trains a one-stage policy (stages = 1)")
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    ensure_process_group()
    work_dir = None if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir) / "network"
    net = network or LocalNetwork(model_dir, settings_from(cfg), work_dir=work_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def evaluate_version(version: int) -> EvalReport:
        report = evaluate((net.model(version), tokenizer), cfg.task, "heldout",
                          n=cfg.eval_problems, k=1, samples=1, seed=cfg.seed)
        net.record_eval(version, report, seed=cfg.seed)
        return report

    stage = load_stage(model_dir, 0, 1)
    runner = PipelineRunner(stage, 0, 1, num_microbatches=cfg.microbatches,
                            temperature=cfg.local.temperature, seed=cfg.seed)
    loop = TrainerLoop(cfg, runner, net, publish=net.publish, evaluate=evaluate_version,
                       weights=net.weights, on_metrics=on_metrics, progress=progress)
    if resume and cfg.checkpoint_dir is not None and loop.resume(
            cfg.checkpoint_dir, published=net.validator.versions.current):
        net.adopt(loop.version, stage)
    return loop.run(), net


class BroadcastSource:
    """Every rank gets the samples rank 0's network serves (pipeline ranks share batches)."""

    def __init__(self, inner: LocalNetwork | None) -> None:
        self.inner = inner

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        box = [self.inner.fetch(cursor, limit) if self.inner is not None else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0]


def run_local_pipeline(cfg: TrainerConfig, *, progress: bool = True,
                       on_metrics: Callable[[int, Metrics], None] | None = None,
                       resume: bool = False) -> History | None:
    """One rank of an S-stage run (under torchrun) against an in-process network on rank 0.

    Rank 0 hosts the network and evaluates; after each step the stages' tensors
    are gathered on rank 0 to register the new version with the in-process
    validator (a stand-in for per-stage weight publication). Returns the
    history on rank 0, None elsewhere.
    """
    rank, world = init_distributed()
    if world != cfg.stages:
        raise ConfigError(f"stages = {cfg.stages} but torchrun started {world} processes")
    model_dir = Path(cfg.model_dir) if cfg.model_dir else ensure_base_model(cfg.task)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work_dir = None if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir) / "network"
    net = LocalNetwork(model_dir, settings_from(cfg), work_dir=work_dir) if rank == 0 else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if rank == 0 else None

    def publish(version: int, stage: torch.nn.Module) -> None:
        own = {k: v for k, v in stage.state_dict().items() if "rotary" not in k}
        parts: list = [None] * world if rank == 0 else []
        dist.gather_object(own, parts if rank == 0 else None, dst=0)
        if net is not None:
            state = {k: v for part in parts for k, v in part.items()}
            if version < 0:
                net.adopt_state(-version, state)
            else:
                net.publish_state(version, state)

    def evaluate_version(version: int) -> EvalReport | None:
        if net is None:
            return None
        report = evaluate((net.model(version), tokenizer), cfg.task, "heldout",
                          n=cfg.eval_problems, k=1, samples=1, seed=cfg.seed)
        net.record_eval(version, report, seed=cfg.seed)
        return report

    runner = PipelineRunner(load_stage(model_dir, rank, world), rank, world,
                            num_microbatches=cfg.microbatches,
                            temperature=cfg.local.temperature, seed=cfg.seed)
    loop = TrainerLoop(cfg, runner, BroadcastSource(net), publish=publish,
                       evaluate=evaluate_version, on_metrics=on_metrics if rank == 0 else None,
                       progress=progress)
    try:
        if resume and cfg.checkpoint_dir is not None:
            head = [net.validator.versions.current if net is not None else 0]
            dist.broadcast_object_list(head, src=0)  # every rank re-runs up to the same version
            if loop.resume(cfg.checkpoint_dir, published=head[0]):
                publish(-loop.version, runner.stage)  # negative: adopt, do not announce
        history = loop.run()
        if net is not None:
            print(f"network: {dict(net.stats.verdicts)} audited={net.stats.audited}",
                  file=sys.stderr)
        return history if rank == 0 else None
    finally:
        if net is not None:
            net.close()
