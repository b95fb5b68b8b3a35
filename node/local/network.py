"""An in-process network: one validator core, N contributors, a policy-version registry.

Everything a real run does except sockets: contributors answer signed
assignments (honestly; the harness's subclass, ``harness.local.AdversarialNetwork``,
also plays the strategies of ``harness.adversaries``), the
validator core admits, scores, spot-checks and records them in its ledger, and
accepted samples are served by cursor (``fetch``, a ``trainer.buffer.SampleSource``).

Policy versions: ``publish(version, stage)`` encodes the new weights as one
compressed update (``trainer.publish.StagePublisher``: the configured codec with
error feedback, a full snapshot every ``snapshot_every`` versions), puts the
blob in the ledger's blob store, signs the manifest with the network's trainer
key and records it with the validator, so assignments from then on name the
new version and spot checks recompute under it. The registry
(``node.local.versions``, bounded to the staleness window) holds the *published copy*, the
weights every contributor rebuilds from the chain (``rollout.sync.PolicySync``), not the trainer's own:
contributors sample from it, spot checks recompute under it and evals score it.
``publish_delay = s`` holds each version back for s further publications: the
validator then assigns version v - s while the trainer is at v, which is how
benchmarks emulate staleness s with every sample still verified.

``fetch`` produces ``groups_per_fetch`` new groups when the stream has nothing
past ``cursor`` (``auto_produce``), so a trainer loop can pull from it directly.

Determinism: the network's keys and randomness are functions of fixed names
and ``seed`` (a simulation holds no secrets), so a run repeats with its seed.
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
from transformers import PreTrainedModel

from ledger.log import Ledger
from ledger.reputation import aggregation_weight
from node.config import AssignmentSection, AuditSection, NodeSection, ValidatorConfig
from node.local.versions import RegistryOracle, VersionRegistry
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import StateStore
from rewards.tasks.base import generate as generate_problems
from rollout.backends import TransformersBackend, generate_grouped
from rollout.loading import load_pretrained_lm
from rollout.oracle import UnknownPolicyVersion
from rollout.sync import PolicySync
from rollout.worker import honest_request, sign_completions
from trainer.evals import EvalReport, eval_statement
from trainer.network_rules import NetworkRules
from trainer.publish import StagePublisher, build_manifest
from verify.errors import AdmissionError, ConfigError, VerificationError
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.spotcheck import FLOAT32_TOLERANCE
from verify.types import (
    GroupSubmission,
    SampleBatch,
    SignedAssignment,
    SignedManifest,
    WorkAssignment,
    canonical_bytes,
    decode,
)


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


def _sole_reference() -> int:
    """What ``sys.getrefcount`` says of an object that one local name alone holds (2 on
    CPython 3.11: the name and the call's argument), measured rather than assumed."""
    held = object()
    return sys.getrefcount(held)


_SOLE_REFERENCE = _sole_reference()


def local_trainer_key() -> SigningKey:
    """The in-process network's trainer key (deterministic: simulations are not secrets)."""
    return SigningKey.from_seed(blake3.blake3(b"local-trainer").digest())


def local_validator_key() -> SigningKey:
    """The in-process network's validator (ledger) key, deterministic like the trainer's."""
    return SigningKey.from_seed(blake3.blake3(b"local-validator").digest())


@dataclass(frozen=True)
class LocalSettings:
    """What the in-process network is made of."""

    contributors: int = 4
    adversaries: tuple[str, ...] = ()
    """Strategy names, one extra contributor each (played by a subclass: :meth:`LocalNetwork.answer_as`)."""
    group_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    pool: int = 8192
    task: str = "arithmetic"
    seed: int = 0
    rules: NetworkRules = NetworkRules()
    """The network's shared settings; the validator admits within ``max_staleness +
    publish_delay`` (the versions it holds back are not yet current)."""
    groups_per_fetch: int = 16
    publish_delay: int = 0
    codec: str = "int8-block"
    """Codec of each published update (``verify.weights_codec.CODECS``)."""
    codec_params: tuple[tuple[str, object], ...] = ()
    snapshot_every: int = 50
    """Every N-th version is a full snapshot; 0 never."""
    ttl_s: float = 600.0
    """``assignment.ttl_s``: an unanswered assignment expires this many (wall) seconds after
    it is issued; an abandoned or discarded one holds its contributor's place one more."""


@dataclass
class Stats:
    submitted: int = 0
    admission_errors: Counter[str] = field(default_factory=Counter)
    verdicts: Counter[str] = field(default_factory=Counter)
    audited: int = 0


class LocalNetwork:
    """See the module docstring. ``close()`` releases the ledger and state files."""

    def __init__(
        self,
        model_dir: str | Path,
        settings: LocalSettings = LocalSettings(),
        *,
        work_dir: str | Path | None = None,
    ) -> None:
        self.settings = s = settings
        for name in s.adversaries:
            self.check_strategy(name)
        self.model_dir = Path(model_dir)
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="prooftrain-local-")
        self.work_dir = Path(work_dir or self._tmp.name)  # type: ignore[union-attr]
        self.work_dir.mkdir(parents=True, exist_ok=True)
        base = load_pretrained_lm(self.model_dir, dtype=torch.float32)
        window = s.rules.max_staleness + s.publish_delay
        self.registry = VersionRegistry(base.eval(), keep=window + 2)
        self.codec = HFTextCodec(self.model_dir)
        self.trainer_key = local_trainer_key()
        vkey = local_validator_key()
        cfg = ValidatorConfig(
            node=NodeSection(checkpoint_every=256),
            rules=s.rules.model_copy(update={"max_staleness": window}),
            assignment=AssignmentSection(
                group_size=s.group_size,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                ttl_s=s.ttl_s,
            ),
            audit=AuditSection(epoch_groups=64),
        )
        self.ledger = Ledger.open(
            self.work_dir / "ledger.sqlite", signing_key=vkey, origin="prooftrain/local"
        )
        self.state = StateStore(self.work_dir / "state.sqlite")
        self.versions = PolicyVersions(model_dir_digest(self.model_dir), self.trainer_key.public)
        problems = generate_problems(s.task, "train", s.pool, seed=s.seed)
        self.validator = Validator(
            cfg,
            vkey,
            self.ledger,
            self.state,
            self.codec,
            RegistryOracle(self.registry),
            problems,
            self.versions,
            FLOAT32_TOLERANCE,
            entropy=simulation_entropy(s.seed, self.ledger.size()),
        )
        names = ["honest"] * s.contributors + list(s.adversaries)
        self.contributors: list[tuple[SigningKey, str]] = []
        for i, name in enumerate(names):
            key = SigningKey.from_seed(blake3.blake3(f"local-contributor/{i}".encode()).digest())
            self.validator.register(key.public.raw, f"{name}-{i}")
            self.contributors.append((key, name))
        self._turn = itertools.cycle(range(len(self.contributors)))
        self._held: list[tuple[int, PreTrainedModel, SignedManifest]] = []  # not yet announced
        self._dropped: PreTrainedModel | None = None
        """The model of the version the registry dropped last, for the next published copy."""
        self.publisher = StagePublisher.for_stage(
            base, 0, s.codec, dict(s.codec_params), s.snapshot_every
        )
        self._parent: SignedManifest | None = None
        self._pending_evals: list[tuple[int, EvalReport, int]] = []
        self.stats = Stats()
        current = self.versions.current  # > 0 when reopening a network's work_dir
        if current:
            self._restore_publisher(current)
        self._resumed = not current
        """Whether the contributors took up what a previous process left open (``step``)."""

    def close(self) -> None:
        self.ledger.close()
        self.state.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- rollouts

    def step(self, groups: int) -> None:
        """Have the contributors answer ``groups`` assignments, round-robin.

        A round (each contributor at most once) is issued in one ledger
        transaction, its honest groups are generated in one batch per policy
        version and its groups are admitted together (``Validator.admit_in_turn``:
        a group refused with BACKPRESSURE by an earlier one of its round is
        submitted again alone).
        """
        if not self._resumed:
            self._resumed = True
            self._answer_open()
        turns = [next(self._turn) for _ in range(groups)]
        for lo in range(0, len(turns), len(self.contributors)):
            self._round([self.contributors[i] for i in turns[lo : lo + len(self.contributors)]])

    def _answer_open(self) -> None:
        """After a reopen, the contributors answer the assignments the previous process issued
        them and never answered (it stopped between issuing a round and admitting it), as a
        restarted contributor sends its pending groups: left open, each would hold its
        contributor's place (``assignment.max_outstanding``) until it expired, and a few
        restarts would leave the contributors no work. One of a policy version the
        registry no longer holds is left to expire."""
        issued = []
        for key, name in self.contributors:
            for sealed in self.validator.open_assignments(key.public.raw):
                a = self.validator.open_assignment(sealed)
                if a.policy_version in self.registry:
                    issued.append((key, name, sealed, a))
        if issued:
            self._admit(issued)

    def _round(self, members: list[tuple[SigningKey, str]]) -> None:
        issued = []
        for (key, name), sealed in zip(
            members, self.validator.assign_many([key.public.raw for key, _ in members]), strict=True
        ):
            if isinstance(sealed, AdmissionError):
                self._refused(sealed)
            else:
                issued.append((key, name, sealed, self.validator.open_assignment(sealed)))
        self._admit(issued)

    def _admit(
        self, issued: list[tuple[SigningKey, str, SignedAssignment, WorkAssignment]]
    ) -> None:
        """Answer ``issued`` (honest groups generated in batches) and admit the answers."""
        bodies = self._answers(issued)
        for result in self.validator.admit_in_turn(bodies):
            if isinstance(result, VerificationError):
                self._refused(result)
                continue
            self.stats.submitted += 1
            for v in open_group_verdict(result.answer, self.validator.key.public):
                self.stats.verdicts["accepted" if v.accepted else v.reason] += 1
                self.stats.audited += int(v.audited)

    def _answers(
        self, issued: list[tuple[SigningKey, str, SignedAssignment, WorkAssignment]]
    ) -> list[bytes]:
        """Each issued assignment's group, in order: honest ones generated in batches."""
        honest = [i for i, (_, name, _, _) in enumerate(issued) if name == "honest"]
        done = generate_grouped(
            [
                (
                    issued[i][3].policy_version,
                    honest_request(issued[i][3], issued[i][0].public, self.codec),
                )
                for i in honest
            ],
            lambda version: TransformersBackend(self.registry[version]),
        )
        generated = {i: got[0] for i, got in zip(honest, done, strict=True) if got is not None}
        bodies = []
        for i, (key, name, sealed, a) in enumerate(issued):
            if i in generated:
                group = GroupSubmission(a.assignment_id, sign_completions(key, a, generated[i]))
                bodies.append(canonical_bytes(group))
            else:
                bodies.append(self.answer_as(name, key, sealed, a))
        return bodies

    def check_strategy(self, name: str) -> None:
        """Refuse a contributor strategy this network cannot play: here, any but honest."""
        raise ConfigError(
            f"adversary {name!r}: the in-process network runs honest contributors "
            "only; adversaries play in harness scenarios (`prooftrain harness run`)"
        )

    def answer_as(
        self, strategy: str, key: SigningKey, sealed: SignedAssignment, a: WorkAssignment
    ) -> bytes:
        """The group a contributor playing ``strategy`` (not honest) submits for ``sealed``."""
        raise ConfigError(f"the in-process network cannot play {strategy!r}")

    def _refused(self, exc: VerificationError) -> None:
        self.stats.admission_errors[exc.reason.value if exc.reason else "?"] += 1

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
            raise ConfigError(
                f"the network has published version {self.publisher.version}; "
                f"cannot publish {version}"
            )
        update = self.publisher.update(state)
        assert self.ledger.blobs is not None
        self.ledger.blobs.put(update.blob)
        sealed = build_manifest(
            version,
            self._parent,
            self.versions.base_digest,
            [update],
            self.publisher.codec_name,
            self.trainer_key,
            self.validator.clock(),
        )
        self._parent = sealed
        self._held.append((version, self._published_model(), sealed))
        while len(self._held) > self.settings.publish_delay:
            v, m, manifest = self._held.pop(0)
            dropped = self.registry.add(v, m)
            self._dropped = dropped[-1] if dropped else None
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
            self.validator.record_eval(
                eval_statement(
                    report,
                    version=version,
                    manifest_digest=digest or b"",
                    task=report.task,
                    split=report.split,
                    seed=seed,
                    key=self.trainer_key,
                    created_at_ms=self.validator.clock(),
                )
            )

    def _published_model(self) -> PreTrainedModel:
        """A model holding a copy of the published weights: the base model's structure and
        buffers, each parameter copied once, straight from the published state (a tied one
        once for both names). The copy goes into the model of the version the registry
        dropped last when nothing else holds that model any more (a cached generation
        backend, say): its memory is already paged in, where a fresh copy of every
        parameter would be paged in again each version."""
        state = self.publisher.published_state()
        spare, self._dropped = self._dropped, None
        if spare is not None and sys.getrefcount(spare) <= _SOLE_REFERENCE:
            params = dict(spare.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for name, value in state.items():
                    params[name].copy_(value)
            return spare
        del spare
        base = self.registry[0]
        params = dict(base.named_parameters(remove_duplicate=False))
        missing = sorted(set(state) - set(params))
        if missing:
            raise ValueError(f"base model lacks published parameters {missing[:5]}")
        memo: dict[int, object] = {}
        for name, value in state.items():
            p = params[name]
            memo[id(p)] = torch.nn.Parameter(
                value.to(p.dtype, copy=True), requires_grad=p.requires_grad
            )
        uncovered = [n for n, p in params.items() if id(p) not in memo]
        if uncovered:
            raise ValueError(f"published state lacks parameters {uncovered[:5]}")
        return copy.deepcopy(base, memo).eval()

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
        self.publisher.load_state(
            {
                "version": version,
                "own": {n: rebuilt[n] for n in own},
                "mirror": {},
                "residual": {},
            }
        )
        self._parent = self.manifest(version) if version else None
        if version:
            self.registry.add(version, self._published_model())

    def weight(self, contributor: bytes) -> float:
        """Reputation score in (0, 1), capped while the key is on probation
        (``ledger.reputation.aggregation_weight``): a contributor weight for robust
        aggregation."""
        return aggregation_weight(self.ledger.reputation(contributor), self.ledger.params)

    def weights(self, contributors: Sequence[bytes]) -> torch.Tensor:
        return torch.tensor([self.weight(c) for c in contributors], dtype=torch.float64)
