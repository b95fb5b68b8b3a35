"""Red-team benchmark: every known attack against a fresh in-process validator core.

Threat model: the attacker reads the code, holds registered keys of its own
(as many as it likes: a banned identity is replaced by a fresh one), signs
everything it sends with them, and may run the policy (and a logprob oracle)
itself. Each attack runs twice, each time in a fresh validator (its own
ledger and state under a temporary directory) built as ``prooftrain
validator`` builds one (demo base model, G = 4, max_tokens = 16, T = 1, the
built-in per-precision tolerances), with an honest control contributor beside
it (a group after every third attack group):

  per_audit     ``rules.audit_rate = 1.0``: every rollout is spot-checked.
                A banned attacker continues under a fresh key, so every group
                is an independent trial.
  default_rate  ``rules.audit_rate = -1`` (reputation-driven). Each identity
                first submits --warmup honest groups to earn a low audit rate
                (``audit_rate_after_warmup``), then attacks until it is banned;
                it burns at most --identities identities (``unplayed``: the
                groups left when all are banned).

Every attack group is compared with the honest sample for the same assignment
and key (same tokens and headers, the declared precision and engine aside;
logprobs within the float32 tolerance): a group identical to it *is* honest
output and cannot be rejected. Per attack and mode: ``submitted``,
``rejected`` (any member), ``slashed``, ``accepted``, ``reasons`` (member
verdict reasons, GROUP_REJECTED left out), ``refused`` (refusals before
judging), ``identities``, ``differing`` / ``identical`` groups,
``rejected_of_differing``, ``differing_accepted`` (cheating groups that got
in), ``rejected_identical``, ``accepted_mean_reward`` beside the honest
control's ``honest_mean_reward``, and ``honest_slashed_in_ledger``. Grinding
adds the assignments it obtained and the ``assignment_limit`` refusals; a
validator that saw a PIT failure adds ``pit``: failures, how many are in the
ledger, and how many resubmissions of the same bytes got the stored verdicts.

``honest`` sums every honest group (controls, warm-ups, the copy attacks'
set-up groups): ``false_rejections``, ``slashes`` and ``ledger_slashes`` must
be 0. The PIT attack's validator runs at ``audit.pit_alpha = 0.2``, where an
honest window fails one time in five: those count as
``expected_pit_rejections``. ``controls`` are honest-only validators that
once caused false slashes: one prompt text under two prompt ids, and a new
policy version with unchanged weights (``repeated_completions``: accepted
completions repeating an earlier one for the same prompt text).
``not_rejected_per_audit`` lists attacks with differing groups accepted under
full audit (an attack that may be, by design, says why in ``tolerated``);
``never_differed_per_audit`` those that never differed from honest output
(nothing to reject). ``skipped`` names the harness strategies left out, and why.

    python bench/redteam.py [--groups 30] [--warmup 30] [--identities 3] [--quick] [--only A,B]
                            [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import itertools
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from harness.adversaries.base import STRATEGIES, Context, make_strategy  # noqa: E402
from ledger.log import Ledger  # noqa: E402
from ledger.records import Slashed, VerdictRecorded  # noqa: E402
from node.config import ValidatorConfig, load  # noqa: E402
from node.validator.core import SLASHED, SubmitResult, Validator  # noqa: E402
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest  # noqa: E402
from node.validator.precheck import score  # noqa: E402
from node.validator.state import StateStore  # noqa: E402
from rewards.base import Problem  # noqa: E402
from rewards.tasks.base import generate  # noqa: E402
from rollout.backends import GeneratedCompletion, TransformersBackend  # noqa: E402
from rollout.oracle import TransformersOracle  # noqa: E402
from rollout.progress import tracked  # noqa: E402
from rollout.worker import answer, header_fields, honest_request, open_assignment  # noqa: E402
from verify.challenge import audit_subject, should_audit  # noqa: E402
from verify.envelope import build_envelope, completion_digest, verify_envelope  # noqa: E402
from verify.errors import AdmissionError, Reason, SpotCheckError, VerificationError  # noqa: E402
from verify.keys import SigningKey  # noqa: E402
from verify.manifest import blob_digest  # noqa: E402
from verify.sampling import noise_for_streams, process_logits  # noqa: E402
from verify.signed import seal  # noqa: E402
from verify.spotcheck import DEFAULT_TOLERANCES, compare_chunk  # noqa: E402
from verify.types import (  # noqa: E402
    GroupSubmission,
    PolicyManifest,
    RolloutHeader,
    ShardEntry,
    SignedAssignment,
    WorkAssignment,
    canonical_bytes,
    decode,
)

GROUP_SIZE, MAX_TOKENS = 4, 16
TTL_MS = 600_000
"""``assignment.ttl_s`` (its default, set explicitly: grinding rounds last this long)."""
HONEST_EVERY = 3
"""An honest control group with every this many attack groups (the first included)."""
AGAIN = "/again"
"""Suffix of the second prompt id of one prompt text (duplicated pools)."""
TRAINER = SigningKey.from_seed(b"\x7e" * 32)
Comp = tuple[int, list[int], np.ndarray]
"""One forged completion: (group index, token ids, committed logprobs)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Clock:
    """Milliseconds: one more at each reading, and advanced by hand (assignments expire when
    the bench says so)."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        self.t = start

    def __call__(self) -> int:
        self.t += 1
        return self.t

    def advance(self, ms: int) -> None:
        self.t += ms


@dataclass
class World:
    """What every validator and contributor of the run shares: the model and its copies."""

    work: Path
    model: Path
    codec: HFTextCodec
    backend: TransformersBackend
    oracle: TransformersOracle
    problems: list[Problem]
    serials: itertools.count = field(default_factory=itertools.count)
    """Numbers keys and validator directories, so every run is reproducible."""
    _variants: dict[str, object] = field(default_factory=dict)

    def key(self) -> SigningKey:
        return SigningKey.from_seed(hashlib.sha256(b"redteam/%d" % next(self.serials)).digest())

    def variant(self, name: str):  # type: ignore[no-untyped-def]
        """A substitute generator, built once: ``noisy`` (1e-3 relative Gaussian weight noise),
        ``bf16`` (a bfloat16 copy), or ``other`` (a directory: a random model, same tokenizer)."""
        if name not in self._variants:
            if name == "noisy":
                model = copy.deepcopy(self.backend.model)
                gen = torch.Generator().manual_seed(7)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p * 1e-3 * torch.randn(p.shape, generator=gen))
                self._variants[name] = TransformersBackend(model)
            elif name == "bf16":
                self._variants[name] = TransformersBackend(self.model, dtype="bfloat16")
            else:
                from harness.tiny_model import build_tiny_model

                self._variants[name] = build_tiny_model(self.work / "other-model", seed=3)
        return self._variants[name]

    def prefix(self) -> list[int]:
        """What the tokenizer puts before any text (a BOS), to strip from planted text."""
        return self.codec.encode("")


@dataclass
class Identity:
    key: SigningKey
    ctx: Context


@dataclass
class Crafted:
    """One attack group: its bytes, its assignment, and whether it is honest output (None:
    compare it with the honest sample)."""

    raw: bytes
    a: WorkAssignment
    differs: bool | None = None


Outcome = SubmitResult | VerificationError


@dataclass
class Tally:
    """What one attack did in one mode."""

    submitted: int = 0
    rejected: int = 0
    slashed: int = 0
    reasons: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    identities: int = 0
    differing: int = 0
    identical: int = 0
    rejected_of_differing: int = 0
    rejected_identical: int = 0
    unplayed: int = 0
    """Groups never played: every identity the attacker may burn was banned."""
    rewards: list[float] = field(default_factory=list)
    """The validator's rewards of the accepted rollouts."""

    def add(self, out: Outcome, differs: bool | None) -> None:
        if isinstance(out, VerificationError):
            self.refused[_reason(out)] += 1
            return
        self.submitted += 1
        bad = rejected(out)
        self.rejected += bad
        self.slashed += slashed(out)
        self.reasons.update(
            r.reason for r in out.verdicts if r.reason and r.reason != "group_rejected"
        )
        self.rewards += [v.reward for v in out.verdicts if v.accepted]
        if differs is not None:
            self.differing += differs
            self.identical += not differs
            self.rejected_of_differing += bad and differs
            self.rejected_identical += bad and not differs

    def json(self) -> dict:
        return {
            "submitted": self.submitted,
            "rejected": self.rejected,
            "slashed": self.slashed,
            "accepted": self.submitted - self.rejected,
            "reasons": dict(self.reasons),
            "refused": dict(self.refused),
            "identities": self.identities,
            "unplayed": self.unplayed,
            "differing": self.differing,
            "identical": self.identical,
            "rejected_of_differing": self.rejected_of_differing,
            "differing_accepted": self.differing - self.rejected_of_differing,
            "rejected_identical": self.rejected_identical,
            "accepted_mean_reward": _mean(self.rewards),
        }


@dataclass
class Honest:
    """Every honest group of the whole run."""

    groups: int = 0
    false_rejections: int = 0
    slashes: int = 0
    expected_pit_rejections: int = 0
    reasons: Counter = field(default_factory=Counter)


def rejected(out: SubmitResult) -> bool:
    return not all(v.accepted for v in out.verdicts)


def slashed(out: SubmitResult) -> bool:
    return any(v.reason in SLASHED for v in out.verdicts)


def _reason(exc: VerificationError) -> str:
    return exc.reason.value if exc.reason is not None else type(exc).__name__


class Run:
    """One fresh validator (one audit mode), its clock and its honest control."""

    def __init__(
        self,
        world: World,
        honest: Honest,
        rate: float,
        overrides: dict | None = None,
        problems: list[Problem] | None = None,
        versions: int = 1,
    ) -> None:
        self.world, self.honest_totals = world, honest
        self.clock = Clock()
        self.cfg = load(
            ValidatorConfig,
            None,
            {
                "assignment.group_size": GROUP_SIZE,
                "assignment.max_tokens": MAX_TOKENS,
                "assignment.ttl_s": TTL_MS / 1000,
                "rules.audit_rate": rate,
                **(overrides or {}),
            },
        )
        where = world.work / f"v{next(world.serials)}"
        key = world.key()
        oracle = (
            world.oracle
            if versions == 1
            else TransformersOracle({i: world.model for i in range(versions)})
        )
        self.v = Validator(
            self.cfg,
            key,
            Ledger.open(where / "ledger.sqlite", signing_key=key, origin="bench/redteam"),
            StateStore(where / "state.sqlite"),
            world.codec,
            oracle,
            problems or world.problems,
            PolicyVersions(model_dir_digest(world.model), TRAINER.public),
            DEFAULT_TOLERANCES,
            clock=self.clock,
        )
        self.by_id = {p.id: p for p in (problems or world.problems)}
        self.shared: dict = {}
        self.honest_keys: set[bytes] = set()
        """Keys that only ever send honest groups (controls, the copy attack's colluder)."""
        self.control = self.identity("honest-control", honest=True)
        self.completions: set[tuple[bytes, bytes]] = set()
        self.repeats = 0
        """Honest accepted completions whose tokens repeat one accepted before for the same
        prompt text (each is always audited)."""
        self.control_rewards: list[float] = []
        self.pit: Counter = Counter()

    def close(self) -> None:
        self.v.ledger.close()
        self.v.state.close()

    def identity(self, name: str, honest: bool = False) -> Identity:
        key = self.world.key()
        self.v.register(key.public.raw, name)
        if honest:
            self.honest_keys.add(key.public.raw)
        ctx = Context(
            key,
            self.world.backend,
            self.world.codec,
            self.v.key.public,
            self.world.oracle,
            shared=self.shared,
            rng=np.random.default_rng(int.from_bytes(key.public.raw[:4], "little")),
        )
        return Identity(key, ctx)

    def banned(self, me: Identity) -> bool:
        return self.v.ledger.is_banned(me.key.public.raw)

    def honest_slashes(self) -> int:
        """Slashes the ledger records against keys that only sent honest groups."""
        return sum(
            isinstance(r, Slashed) and r.contributor in self.honest_keys
            for _, r in self.v.ledger.entries()
        )

    def sealed(self, me: Identity) -> SignedAssignment:
        return self.v.assign(me.key.public.raw)

    def assign(self, me: Identity) -> WorkAssignment:
        return self.open(self.sealed(me), me)

    def open(self, sealed: SignedAssignment, me: Identity) -> WorkAssignment:
        return open_assignment(sealed, self.v.key.public, me.key.public)

    def submit(self, raw: bytes) -> Outcome:
        try:
            out = self.v.admit(raw)
        except VerificationError as exc:
            return exc
        if "sampling_distribution" in out.reasons:
            self._check_pit_record(raw, out)
        return out

    def _check_pit_record(self, raw: bytes, out: SubmitResult) -> None:
        """A PIT failure is in the ledger, and the same bytes again get the stored verdicts."""
        aid = out.verdicts[0].assignment_id
        self.pit["failures"] += 1
        self.pit["in_ledger"] += any(
            isinstance(r, VerdictRecorded)
            and r.assignment_id == aid
            and r.reason == "sampling_distribution"
            for _, r in self.v.ledger.entries()
        )
        again = self.submit(raw)
        self.pit["resubmission_stored"] += (
            isinstance(again, SubmitResult) and not again.fresh and again.answer == out.answer
        )

    def honest(self, me: Identity, sealed: SignedAssignment | None = None) -> tuple[bytes, Outcome]:
        """An honest group by ``me`` (for ``sealed``, else a new assignment), counted as honest."""
        raw, h = b"", self.honest_totals
        h.groups += 1
        try:
            sealed = sealed or self.sealed(me)
        except VerificationError as exc:  # an honest key refused work (banned?)
            out: Outcome = exc
        else:
            sub = answer(
                me.key, sealed, self.v.key.public, self.world.backend, self.world.codec, self.clock
            )
            raw = canonical_bytes(sub)
            out = self.submit(raw)
            if isinstance(out, SubmitResult):
                self._count_repeats(sub, out)
        if isinstance(out, VerificationError):
            h.false_rejections += 1
            h.reasons[_reason(out)] += 1
        elif rejected(out):
            reasons = {v.reason for v in out.verdicts} - {"group_rejected"}
            pit_expected = reasons == {"sampling_distribution"} and self.cfg.audit.pit_alpha >= 0.01
            h.expected_pit_rejections += pit_expected
            h.false_rejections += not pit_expected
            h.slashes += slashed(out)
            h.reasons.update(reasons)
        if me is self.control and isinstance(out, SubmitResult):
            self.control_rewards += [v.reward for v in out.verdicts if v.accepted]
        return raw, out

    def _count_repeats(self, sub: GroupSubmission, out: SubmitResult) -> None:
        accepted = {v.group_index for v in out.verdicts if v.accepted}
        for env in sub.envelopes:
            h = decode(RolloutHeader, env.header, max_bytes=len(env.header))
            if h.group_index in accepted:
                seen = (h.prompt_digest, bytes(env.body.token_ids))
                self.repeats += seen in self.completions
                self.completions.add(seen)

    def sign(self, me: Identity, a: WorkAssignment, comps: list[Comp], **header: object) -> bytes:
        envs = [
            build_envelope(
                me.key,
                {**header_fields(a, g, self.clock()), **header},
                tokens,
                np.asarray(lps, dtype=np.float32),
            )
            for g, tokens, lps in comps
        ]
        return canonical_bytes(GroupSubmission(a.assignment_id, envs))

    def generate(
        self, me: Identity, a: WorkAssignment, backend: Any = None, **changes: Any
    ) -> list[GeneratedCompletion]:
        """``me``'s group for ``a`` as the honest request makes it, with ``changes``."""
        req = dataclasses.replace(honest_request(a, me.key.public, self.world.codec), **changes)
        return (backend or self.world.backend).generate(req)

    def claimed(self, me: Identity, a: WorkAssignment, tokens: list[int]) -> np.ndarray:
        """The honest logprobs of ``tokens`` under the claimed sampling (what an oracle gives)."""
        return me.ctx.honest_logprobs(a, tokens) if tokens else np.zeros(0, np.float32)

    def differs(self, crafted: Crafted, me: Identity) -> bool:
        """Whether the group is not the honest sample for its assignment and key: other
        headers (but for the declared precision and engine), other tokens, or logprobs
        outside the float32 tolerance of the honest (float32) ones."""
        a = crafted.a
        honest = self.generate(me, a)
        group = decode(GroupSubmission, crafted.raw, max_bytes=len(crafted.raw))
        if len(group.envelopes) != len(honest):
            return True
        tol = DEFAULT_TOLERANCES.of("float32")
        for env, c in zip(group.envelopes, honest, strict=True):
            h = decode(RolloutHeader, env.header, max_bytes=len(env.header))
            # The declared precision and engine are the contributor's to choose: not compared.
            want = header_fields(
                a, c.group_index, h.created_at_ms, precision=h.precision, backend=h.backend
            )
            if h.contributor_key != me.key.public.raw or any(
                getattr(h, k) != x for k, x in want.items()
            ):
                return True
            tokens = np.frombuffer(env.body.token_ids, "<u4")
            if tokens.tolist() != list(c.token_ids):
                return True
            lps = np.frombuffer(env.body.logprobs, "<f4")
            try:
                for lo in range(0, len(lps), a.chunk_size):
                    compare_chunk(
                        lps[lo : lo + a.chunk_size], c.logprobs[lo : lo + a.chunk_size], tol, 0
                    )
            except SpotCheckError:
                return True
        return False


# -- attacks ------------------------------------------------------------------------------


class Attack:
    """One attack: ``craft`` answers one assignment of ``me`` (obtained itself) as it cheats."""

    family = ""
    overrides: dict = {}
    honest_every = HONEST_EVERY
    tolerated = ""
    """Why a differing group of this attack may pass a full audit by design ("": none may)."""

    def pool(self, world: World) -> list[Problem] | None:
        return None

    def craft(self, run: Run, me: Identity) -> Crafted | None:
        raise NotImplementedError

    def report(self, run: Run) -> dict:
        return {}


class Forged(Attack):
    """Forges the completions of one assignment with ``make`` and signs them (header
    fields in ``header`` override the honest ones)."""

    def __init__(
        self,
        family: str,
        make: Callable[[Run, Identity, WorkAssignment], list[Comp]],
        header: dict | None = None,
        overrides: dict | None = None,
        honest_every: int = HONEST_EVERY,
        tolerated: str = "",
    ) -> None:
        self.family, self.make, self.header = family, make, header or {}
        self.overrides, self.honest_every, self.tolerated = overrides or {}, honest_every, tolerated

    def craft(self, run: Run, me: Identity) -> Crafted:
        a = run.assign(me)
        return Crafted(run.sign(me, a, self.make(run, me, a), **self.header), a)


class Strategy(Attack):
    """A strategy of ``harness.adversaries`` (one instance per validator; its identities share
    ``shared``, as colluding Sybils do)."""

    family = "harness"

    def __init__(self, name: str, world: World) -> None:
        params = {"model_dir": str(world.variant("other"))} if name == "wrong-model" else {}
        self.strategy = make_strategy(name, **params)

    def craft(self, run: Run, me: Identity) -> Crafted:
        sealed = run.sealed(me)
        body = self.strategy.answer(me.ctx, sealed)  # None: a group kept back, sent as nothing
        return Crafted(b"" if body is None else body, run.open(sealed, me))

    def report(self, run: Run) -> dict:
        expect = self.strategy.expect
        return {"expect": expect if isinstance(expect, str) else sorted(r.value for r in expect)}


def duplicated(problems: list[Problem]) -> list[Problem]:
    """Each prompt text twice in a row, under two prompt ids (same prompt digest)."""
    return [
        q for p in problems for q in (p, Problem(p.id + AGAIN, p.task, p.prompt, p.answer, p.data))
    ]


class Copy(Attack):
    """Copies a group accepted earlier for the same prompt text (its own, or a colluder's),
    moves one logprob by one float32 ulp, and signs it for its new assignment."""

    family = "copy"

    def __init__(self, own: bool) -> None:
        self.own = own
        self.donor: Identity | None = None

    def pool(self, world: World) -> list[Problem]:
        return duplicated(world.problems)

    def craft(self, run: Run, me: Identity) -> Crafted:
        if self.own:
            donor = me
        else:
            donor = self.donor = self.donor or run.identity("colluder", honest=True)
        while True:  # the donor answers the first id of a prompt text; the copy gets the second
            sealed = run.sealed(donor)
            raw, out = run.honest(donor, sealed)
            first = not run.open(sealed, donor).prompt_id.endswith(AGAIN)
            if first and isinstance(out, SubmitResult) and not rejected(out):
                break
        a = run.assign(me)
        comps = []
        for env in decode(GroupSubmission, raw, max_bytes=len(raw)).envelopes:
            h = decode(RolloutHeader, env.header, max_bytes=len(env.header))
            lps = np.frombuffer(env.body.logprobs, "<f4").copy()
            if h.group_index == 0:
                lps[-1] = np.nextafter(lps[-1], np.float32(-np.inf))
            comps.append((h.group_index, np.frombuffer(env.body.token_ids, "<u4").tolist(), lps))
        return Crafted(run.sign(me, a, comps), a)


class Grind(Attack):
    """Asks for ``k`` assignments at a time, generates every one it gets, submits only the group
    the validator will reward most (it scores them itself) and lets the rest expire. Each round
    lasts one ``ttl_s``."""

    family = "grinding"
    honest_every = 1  # an honest reward baseline every round

    def __init__(self, k: int) -> None:
        self.k = k
        self.rounds = self.obtained = 0
        self.refusals: Counter = Counter()
        self.generated: list[float] = []
        """The rewards of every group it generated (an honest contributor's, on these prompts)."""

    def craft(self, run: Run, me: Identity) -> Crafted | None:
        run.clock.advance(TTL_MS + 1)  # last round's leftovers expire
        self.rounds += 1
        got = []
        for _ in range(self.k):
            try:
                got.append(run.assign(me))
            except VerificationError as exc:
                self.refusals[_reason(exc)] += 1
        self.obtained += len(got)
        best: tuple[float, WorkAssignment, list[GeneratedCompletion]] | None = None
        for a in got:
            comps = run.generate(me, a)
            rewards = score(
                run.world.codec, run.by_id[a.prompt_id], [np.asarray(c.token_ids) for c in comps]
            )
            self.generated += rewards
            if best is None or float(np.mean(rewards)) > best[0]:
                best = (float(np.mean(rewards)), a, comps)
        if best is None:
            return None
        _, a, comps = best
        return Crafted(
            run.sign(me, a, [(c.group_index, list(c.token_ids), c.logprobs) for c in comps]),
            a,
            differs=False,
        )

    def report(self, run: Run) -> dict:
        return {
            "rounds": self.rounds,
            "assignments_obtained": self.obtained,
            "max_outstanding": run.cfg.assignment.max_outstanding,
            "assignment_limit_refusals": self.refusals.get("assignment_limit", 0),
            "refusals": dict(self.refusals),
            "generated_mean_reward": _mean(self.generated),
        }


def _mean(xs: list[float]) -> float | None:
    return round(float(np.mean(xs)), 3) if xs else None


# -- completion forgers (Forged) -------------------------------------------------------------


def overlong(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
    """4 x max_tokens, past every stop token."""
    comps = run.generate(me, a, max_tokens=4 * a.sampling.max_tokens, stop_token_ids=())
    return [(c.group_index, list(c.token_ids), c.logprobs) for c in comps]


def empty(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
    return [(g, [], np.zeros(0, np.float32)) for g in range(a.group_size)]


def first_token(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
    """An honest completion cut to its first token."""
    return [(c.group_index, list(c.token_ids[:1]), c.logprobs[:1]) for c in run.generate(me, a)]


def planted(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
    """The honest sample as far as it goes before its stop token (as long as room allows),
    then the correct answer and a stop token, all committed with their honest logprobs: only
    the planted tokens are not the sampler's."""
    prefix = run.world.prefix()
    answer_ids = run.world.codec.encode(run.by_id[a.prompt_id].answer)[len(prefix) :] + list(
        a.stop_token_ids
    )
    room = max(0, a.sampling.max_tokens - len(answer_ids))
    out = []
    for c in run.generate(me, a):
        honest = [t for t in c.token_ids if t not in a.stop_token_ids][:room]
        tokens = honest + answer_ids
        out.append((c.group_index, tokens, run.claimed(me, a, tokens)))
    return out


def relogged(transform: Callable[[np.ndarray], np.ndarray]):  # type: ignore[no-untyped-def]
    """Honest tokens with their committed logprobs transformed."""

    def make(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
        return [
            (c.group_index, list(c.token_ids), transform(np.array(c.logprobs)))
            for c in run.generate(me, a)
        ]

    return make


def bf16_cast(lps: np.ndarray) -> np.ndarray:
    return torch.from_numpy(lps).to(torch.bfloat16).to(torch.float32).numpy()


def substitute(variant: str):  # type: ignore[no-untyped-def]
    """Generated by a substitute model, its own logprobs committed, float32 declared."""

    def make(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
        comps = run.generate(me, a, backend=run.world.variant(variant))
        return [(c.group_index, list(c.token_ids), c.logprobs) for c in comps]

    return make


def cheaper(**changes: object):  # type: ignore[no-untyped-def]
    """Sampled with ``changes`` (the verifiable sampler's own noise), committed with the honest
    logprobs of the claimed sampling."""

    def make(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
        comps = run.generate(me, a, **changes)
        return [
            (c.group_index, list(c.token_ids), run.claimed(me, a, list(c.token_ids))) for c in comps
        ]

    return make


def replay_slack(precision: str):  # type: ignore[no-untyped-def]
    """At each step the most probable token among those whose Gumbel score is within the
    replay check's eps for ``precision`` of the max (a hair inside it, for rounding)."""
    eps = 2 * DEFAULT_TOLERANCES.of(precision).token_abs * 0.95

    def make(run: Run, me: Identity, a: WorkAssignment) -> list[Comp]:
        return slack_sample(run, me, a, eps)

    return make


@torch.inference_mode()
def slack_sample(run: Run, me: Identity, a: WorkAssignment, eps: float) -> list[Comp]:
    s, g_size = a.sampling, a.group_size
    model = run.world.backend.model
    prompt = run.world.codec.encode(a.prompt)
    seqs = torch.tensor([prompt] * g_size, dtype=torch.long)
    stops = set(a.stop_token_ids)
    tokens: list[list[int]] = [[] for _ in range(g_size)]
    lps: list[list[float]] = [[] for _ in range(g_size)]
    for t in range(s.max_tokens):
        live = [g for g in range(g_size) if not (tokens[g] and tokens[g][-1] in stops)]
        if not live:
            break
        lp = process_logits(
            model(input_ids=seqs).logits[:, -1, :].float(), s.temperature, s.top_k, s.top_p
        )
        noise = noise_for_streams(
            [(me.key.public.raw, a.nonce, s.seed, g, [t]) for g in range(g_size)], lp.shape[-1]
        )
        scores = lp.double() + noise  # (G, V)
        near = scores >= scores.max(dim=-1, keepdim=True).values - eps
        pick = lp.masked_fill(~near, float("-inf")).argmax(dim=-1)  # (G,)
        for g in live:
            tokens[g].append(int(pick[g]))
            lps[g].append(float(lp[g, pick[g]]))
        seqs = torch.cat([seqs, pick[:, None]], dim=1)
    return [(g, tokens[g], np.asarray(lps[g], np.float32)) for g in range(g_size)]


PIT = {"audit.pit_alpha": 0.2, "audit.pit_min_tokens": 32}  # the smallest window allowed
BF16 = {"precision": "bfloat16"}
SLACK = (
    "replay grants numerical-noise slack: under the inverse-CDF sampler a changed token passes where "
    "the keyed uniform lies within replay_slack (2e-4 at float32) of its interval, i.e. next in id "
    "order to a low-mass draw; under Gumbel-max, within eps = 2 x token_abs of the best score"
)
DECLARED = (
    "the declared precision picks the tolerance and the replay slack; a float32 generator may "
    "declare bfloat16 and get its bounds (token_abs 0.25, inverse-CDF replay_slack 0.02)"
)
SKIPPED = {
    "honest": "the honest control itself",
    "malformed-flood": "garbage bytes: refused before judging and never attributed, so nothing to "
    "reject or slash (tests/integration/test_validator_node.py covers it)",
}


def attacks(world: World) -> dict[str, Callable[[], Attack]]:
    """Every attack by name: a factory making a fresh one for each validator."""
    out: dict[str, Callable[[], Attack]] = {
        "stop-overlong": lambda: Forged("stopping_rule", overlong),
        "stop-empty": lambda: Forged("stopping_rule", empty),
        "stop-first-token": lambda: Forged("stopping_rule", first_token),
        "planted-chunk1": lambda: Forged("chunk_size", planted, header={"chunk_size": 1}),
        "planted": lambda: Forged("chunk_size", planted),
        # Honest control every group: its windows fail one in five at this alpha, which
        # exercises the recording of a PIT failure and the stored answer to a resubmission.
        "pit-temp0.7": lambda: Forged(
            "pit", cheaper(temperature=0.7), overrides=PIT, honest_every=1
        ),
        "copy-colluder": lambda: Copy(own=False),
        "copy-own": lambda: Copy(own=True),
        "sub-round2": lambda: Forged("substitution", relogged(lambda x: np.round(x, 2))),
        "sub-bf16-cast": lambda: Forged("substitution", relogged(bf16_cast)),
        "sub-noisy-policy": lambda: Forged("substitution", substitute("noisy")),
        "sub-bf16-policy": lambda: Forged("substitution", substitute("bf16")),
        "sub-replay-slack": lambda: Forged(
            "substitution", replay_slack("float32"), tolerated=SLACK
        ),
        # The same, and a substitute model, declaring bfloat16 (any contributor may).
        "bf16-declared-replay-slack": lambda: Forged(
            "declared_precision", replay_slack("bfloat16"), header=BF16, tolerated=DECLARED
        ),
        "bf16-declared-noisy-policy": lambda: Forged(
            "declared_precision", substitute("noisy"), header=BF16, tolerated=DECLARED
        ),
        "grind-k3": lambda: Grind(3),
        "grind-k8": lambda: Grind(8),
        "cheap-top20": lambda: Forged("cheaper_sampling", cheaper(top_k=20), tolerated=SLACK),
        "cheap-temp0.9": lambda: Forged(
            "cheaper_sampling", cheaper(temperature=0.9), tolerated=SLACK
        ),
        "cheap-temp1.1": lambda: Forged(
            "cheaper_sampling", cheaper(temperature=1.1), tolerated=SLACK
        ),
    }
    for name in sorted(set(STRATEGIES) - set(SKIPPED)):
        out[name] = lambda name=name: Strategy(name, world)  # type: ignore[misc]
    return out


# -- drivers ------------------------------------------------------------------------------------


def play(
    world: World,
    honest: Honest,
    make: Callable[[], Attack],
    groups: int,
    rate: float,
    warmup: int = 0,
    identities: int = 1_000_000,
) -> dict:
    """``groups`` attack groups against a fresh validator auditing at ``rate`` (-1: by
    reputation). A banned attacker goes on under a fresh key, which first submits ``warmup``
    honest groups, while it has ``identities`` to burn."""
    attack = make()
    run = Run(world, honest, rate, attack.overrides, attack.pool(world))
    tally, me, rates = Tally(), None, []
    for i in range(groups):
        if me is None or run.banned(me):
            if tally.identities == identities:
                tally.unplayed = groups - i
                break
            me, tally.identities = run.identity("attacker"), tally.identities + 1
            for _ in range(warmup):
                run.honest(me)
            rates.append(run.v.ledger.audit_rate(me.key.public.raw))
        try:
            crafted = attack.craft(run, me)
        except AdmissionError as exc:
            if exc.reason is not Reason.ASSIGNMENT_LIMIT:
                raise
            # Its discards hold its places (two ttl each): it waits for one to free.
            tally.refused[_reason(exc)] += 1
            run.clock.advance(2 * TTL_MS + 1)
            continue
        if crafted is not None:
            differs = crafted.differs if crafted.differs is not None else run.differs(crafted, me)
            tally.add(run.submit(crafted.raw), differs)
        if i % attack.honest_every == 0:
            run.honest(run.control)
    result = {
        **tally.json(),
        "honest_mean_reward": _mean(run.control_rewards),
        **attack.report(run),
        "honest_slashed_in_ledger": run.honest_slashes(),
    }
    if rate < 0:
        result["audit_rate_after_warmup"] = _mean(rates)
    if run.pit:
        result["pit"] = dict(run.pit)
    run.close()
    return result


def control_duplicate_text(world: World, honest: Honest, groups: int) -> dict:
    """Honest contributors on a pool holding every prompt text under two prompt ids."""
    before = dataclasses.replace(honest, reasons=Counter(honest.reasons))
    run = Run(world, honest, -1.0, problems=duplicated(world.problems))
    people = [
        run.control,
        run.identity("honest-2", honest=True),
        run.identity("honest-3", honest=True),
    ]
    for i in range(groups):
        run.honest(people[i % len(people)])
    return _control(run, honest, before)


def control_unchanged_version(world: World, honest: Honest, groups: int) -> dict:
    """Honest contributors answer every prompt under version 0, one more after version 1 (the
    same weights) is published, then every prompt again under version 1."""
    before = dataclasses.replace(honest, reasons=Counter(honest.reasons))
    size = max(2, groups // 2)
    run = Run(
        world,
        honest,
        -1.0,
        {"assignment.max_prompt_share": 1.0},  # two keys answer every prompt of a tiny pool
        problems=world.problems[: size + 1],
        versions=2,
    )
    people = [run.control, run.identity("honest-2", honest=True)]
    for i in range(size):
        run.honest(people[i % 2])
    held = run.sealed(people[0])
    blob = b"unchanged weights"
    run.v.ledger.blobs.put(blob)  # type: ignore[union-attr]
    manifest = PolicyManifest(
        1,
        1,
        b"",
        model_dir_digest(world.model),
        [ShardEntry(0, blob_digest(blob), "int8-block", len(blob), "delta")],
        TRAINER.public.raw,
        run.clock(),
    )
    version = run.v.publish_policy(seal(TRAINER, manifest))
    run.honest(people[0], held)  # a version-0 assignment answered after version 1 is out
    for i in range(size + 1):
        run.honest(people[i % 2])
    return _control(run, honest, before, published=version)


def _control(run: Run, honest: Honest, before: Honest, **extra: object) -> dict:
    """What the honest groups of a control validator met; ``repeated_completions``: accepted
    completions repeating an earlier one for the same prompt text (the case that was slashed)."""
    slashes = sum(isinstance(r, Slashed) for _, r in run.v.ledger.entries())
    run.close()
    return {
        "groups": honest.groups - before.groups,
        "false_rejections": honest.false_rejections - before.false_rejections,
        "slashes": honest.slashes - before.slashes,
        "ledger_slashes": slashes,
        "repeated_completions": run.repeats,
        "reasons": dict(honest.reasons - before.reasons),
        **extra,
    }


GRIND_METHODS = ("abandon", "missing_member", "unsupported_precision", "late", "stale")
GRIND_ASK = 8
"""Assignments a grinder asks for every quarter ``ttl_s``."""
LEAK_GROUPS = 48
"""Cheating groups the audit-draw leak probe plays (its keys' warm-ups come on top)."""
LEAK_WARMUP = 10
"""The fewest honest groups a leak-probe key warms up with: past probation (32 audited
rollouts), so that some of its submissions are not drawn."""


def grinding(world: World, honest: Honest, method: str, windows: int) -> dict:
    """A key that asks for ``GRIND_ASK`` assignments every quarter ``ttl_s``, generates every
    one it gets, submits the best group honestly and discards the rest by ``method``, for
    ``windows`` x 2 ``ttl_s`` at the reputation-driven audit rate. ``kept_reward_gain``: the
    mean reward of its accepted rollouts less that of every rollout it generated (what an
    honest contributor gets on the same prompts)."""
    run = Run(world, honest, -1.0)
    if method == "stale":  # every version it moves to has the base model's weights
        run.v.oracle = TransformersOracle(lambda _version: world.model)
    me = run.identity("grinder")
    step, steps = TTL_MS // 4, 8 * windows
    obtained = kept = 0
    generated: list[float] = []
    kept_rewards: list[float] = []
    late: list[tuple[WorkAssignment, list[Comp]]] = []
    reasons: Counter = Counter()
    for _ in range(steps):
        run.clock.advance(step)
        due = [x for x in late if x[0].expires_at_ms < run.clock.t]
        for a, comps in due:  # answered after expiry
            reasons.update(_first_reasons(run.submit(run.sign(me, a, comps))))
        late = [x for x in late if x not in due]
        got = []
        for _ in range(GRIND_ASK):
            try:
                got.append(run.assign(me))
            except VerificationError as exc:
                reasons[_reason(exc)] += 1
        obtained += len(got)
        scored = []
        for a in got:
            gen = run.generate(me, a)
            rewards = score(
                world.codec, run.by_id[a.prompt_id], [np.asarray(c.token_ids) for c in gen]
            )
            generated += rewards
            forged = [(c.group_index, list(c.token_ids), c.logprobs) for c in gen]
            scored.append((float(np.mean(rewards)), a, forged))
        scored.sort(key=lambda x: -x[0])
        for i, (_, a, comps) in enumerate(scored):
            if i == 0:
                out = run.submit(run.sign(me, a, comps))
                if isinstance(out, SubmitResult):
                    kept += 1
                    kept_rewards += [v.reward for v in out.verdicts if v.accepted]
                continue
            if method == "late":
                late.append((a, comps))
                continue
            if method == "abandon":
                continue
            if method == "stale":
                versions = run.v.versions
                versions.restore(versions.current + run.cfg.rules.max_staleness + 1, bytes(32))
            header = {"precision": "float16"} if method == "unsupported_precision" else {}
            keep = comps[:1] if method == "missing_member" else comps
            reasons.update(_first_reasons(run.submit(run.sign(me, a, keep, **header))))
        if run.banned(me):
            break
    state = run.v.ledger.reputation(me.key.public.raw)
    span = steps * step / (2 * TTL_MS)
    result = {
        "assignments_per_key_per_2ttl": round(obtained / span, 2),
        "kept_groups_per_2ttl": round(kept / span, 2),
        "max_outstanding": run.cfg.assignment.max_outstanding,
        "kept_reward_gain": None
        if not kept_rewards
        else round(float(np.mean(kept_rewards) - np.mean(generated)), 3),
        "kept_mean_reward": _mean(kept_rewards),
        "generated_mean_reward": _mean(generated),
        "reasons": dict(reasons),
        "score": round(state.score, 3),
        "audit_rate": round(run.v.ledger.audit_rate(me.key.public.raw), 3),
        "banned": state.banned,
        "honest_slashed_in_ledger": run.honest_slashes(),
    }
    run.close()
    return result


def _first_reasons(out: Outcome) -> list[str]:
    if isinstance(out, VerificationError):
        return [_reason(out)]
    return [r.reason or "accepted" for r in out.verdicts[:1]]


def audit_draw_leak(
    world: World, honest: Honest, groups: int, warmup: int, busy: float = 0.5
) -> dict:
    """Whether a refusal says anything about the draw. A contributor first earns a low audit
    rate with ``warmup`` honest groups, then samples at temperature 0.9 while claiming 1.0.
    Before each submission, honest or not, the audit queue is held by another group's spot
    check with probability ``busy`` (a flood), and a refused group is re-signed and sent again
    (at most 32 times). A banned key comes back as a fresh one, warmed up again, until
    ``groups`` cheating groups are played. ``refused_drawn`` / ``refused_undrawn``: the
    refusal rate of submissions the draw would audit / would not, under the flood;
    ``groups_to_ban``: the cheating groups each key got in before its ban, with the flood and
    without it."""
    out: dict = {"busy": busy, "honest_slashed_in_ledger": 0}
    for flood in (True, False):
        probe = _Flooded(Run(world, honest, -1.0, {"audit.queue": 1}), busy if flood else 0.0)
        to_ban: list[int] = []
        me, mine = None, 0
        for _ in range(groups):
            if me is None or probe.run.banned(me):
                if me is not None:
                    to_ban.append(mine)
                me, mine = probe.run.identity("flooded"), 0
                for _ in range(warmup):
                    got = probe.group(me)
                    honest.groups += 1
                    if not isinstance(got, SubmitResult) or rejected(got):
                        honest.false_rejections += 1
                        honest.reasons.update(_first_reasons(got))
            mine += 1
            probe.group(me, temperature=0.9)
        if me is not None and probe.run.banned(me):
            to_ban.append(mine)
        out["with_flood" if flood else "without_flood"] = {
            "groups_to_ban": to_ban,
            "mean_groups_to_ban": _mean([float(x) for x in to_ban]),
            "submissions": {"drawn": probe.tries[True][0], "undrawn": probe.tries[False][0]},
        }
        if flood:
            out["refused_drawn"] = probe.refusal_rate(True)
            out["refused_undrawn"] = probe.refusal_rate(False)
        out["honest_slashed_in_ledger"] += probe.run.honest_slashes()
        probe.run.close()
    return out


class _Flooded:
    """Submissions to ``run`` with its audit queue held by another group's spot check with
    probability ``busy`` before each, counted by whether the draw would audit them."""

    def __init__(self, run: Run, busy: float) -> None:
        self.run, self.busy = run, busy
        self.rng = np.random.default_rng(5)
        self.tries = {True: [0, 0], False: [0, 0]}  # drawn? -> [submissions, refusals]

    def group(self, me: Identity, **changes: Any) -> Outcome:
        """A group of ``me``'s generated with ``changes``, re-signed and sent again while it
        is refused (at most 32 times: at ``busy`` 0.5 a group is refused every time once in
        4e9)."""
        run = self.run
        a = run.assign(me)
        gen = run.generate(me, a, **changes)
        comps = [(c.group_index, list(c.token_ids), c.logprobs) for c in gen]
        slots = run.v._checks._audit_slots  # noqa: SLF001 (another group's spot check holds it)
        for _ in range(32):
            raw = run.sign(me, a, comps)
            drawn = _drawn(run, a, raw, me)
            held = self.rng.random() < self.busy and slots.acquire(blocking=False)
            try:
                result = run.submit(raw)
            finally:
                if held:
                    slots.release()
            refused = isinstance(result, AdmissionError) and result.reason is Reason.BACKPRESSURE
            self.tries[drawn][0] += 1
            self.tries[drawn][1] += refused
            if not refused:
                break
        return result

    def refusal_rate(self, drawn: bool) -> float:
        sent, refused = self.tries[drawn]
        return round(refused / max(sent, 1), 3)


def _drawn(run: Run, a: WorkAssignment, raw: bytes, me: Identity) -> bool:
    """Whether the current draw audits any member of the group in ``raw``."""
    secret = run.v._epochs.current  # noqa: SLF001 (the bench reads what no contributor can)
    rate = run.v.ledger.audit_rate(me.key.public.raw)
    sub = decode(GroupSubmission, raw, max_bytes=len(raw))
    for env in sub.envelopes:
        r = verify_envelope(env)
        subject = audit_subject(a.assignment_id, r.header.group_index, completion_digest(r))
        if should_audit(secret, subject, rate):
            return True
    return False


def world_for(work: Path, pool: int) -> World:
    from bench.validator import model_dir

    model = model_dir(work)
    return World(
        work,
        model,
        HFTextCodec(model),
        TransformersBackend(model),
        TransformersOracle({0: model}),
        generate("arithmetic", "train", pool, seed=11),
    )


def run_all(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    torch.set_num_threads(1)  # per-core figures; both sides of every check on one thread
    with tempfile.TemporaryDirectory() as tmp:
        leak = LEAK_GROUPS * (max(args.warmup, LEAK_WARMUP) + 1)  # a warmed-up key per group
        world = world_for(
            Path(tmp), pool=4 * (args.groups + args.warmup * args.identities) + leak + 200
        )
        honest = Honest()
        table = attacks(world)
        if args.only:
            table = {k: f for k, f in table.items() if k in args.only.split(",")}
        results: dict[str, dict] = {}
        for name, make in tracked(table.items(), "attacks", "attacks"):
            began = time.perf_counter()
            audit = play(world, honest, make, args.groups, 1.0)
            default = play(world, honest, make, args.groups, -1.0, args.warmup, args.identities)
            attack = make()
            results[name] = {
                "family": attack.family,
                "per_audit": audit,
                "default_rate": default,
                "seconds": round(time.perf_counter() - began, 1),
            }
            if attack.tolerated:
                results[name]["tolerated"] = attack.tolerated
        log("grinding and the audit-draw leak")
        grind = {m: grinding(world, honest, m, windows=2) for m in GRIND_METHODS}
        leak = audit_draw_leak(world, honest, LEAK_GROUPS, max(args.warmup, LEAK_WARMUP))
        log("honest controls")
        controls = {
            "duplicate_prompt_text": control_duplicate_text(world, honest, args.groups),
            "unchanged_weights_version": control_unchanged_version(world, honest, args.groups),
        }
        model = str(world.model)
    missed = {
        name: {
            "differing": r["per_audit"]["differing"],
            "rejected_of_differing": r["per_audit"]["rejected_of_differing"],
        }
        for name, r in results.items()
        if r["per_audit"]["rejected_of_differing"] < r["per_audit"]["differing"]
    }
    same = sorted(
        name
        for name, r in results.items()
        if r["per_audit"]["differing"] == 0 and r["family"] != "grinding"
    )
    ledger_slashes = sum(
        r[mode]["honest_slashed_in_ledger"]
        for r in results.values()
        for mode in ("per_audit", "default_rate")
    )
    ledger_slashes += sum(c["ledger_slashes"] for c in controls.values())
    ledger_slashes += sum(g["honest_slashed_in_ledger"] for g in grind.values())
    ledger_slashes += leak["honest_slashed_in_ledger"]
    return {
        "bench": "redteam",
        "groups": args.groups,
        "warmup_groups": args.warmup,
        "identities": args.identities,
        "group_size": GROUP_SIZE,
        "max_tokens": MAX_TOKENS,
        "attacks": results,
        "skipped": SKIPPED,
        "not_rejected_per_audit": missed,
        "never_differed_per_audit": same,
        "grinding": grind,
        "audit_draw_leak": leak,
        "honest": {
            "groups": honest.groups,
            "false_rejections": honest.false_rejections,
            "slashes": honest.slashes,
            "ledger_slashes": ledger_slashes,
            "expected_pit_rejections": honest.expected_pit_rejections,
            "reasons": dict(honest.reasons),
            "controls": controls,
        },
        "wall_s": round(time.perf_counter() - start, 1),
        "model": model,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=30, help="attack groups per attack and mode")
    parser.add_argument(
        "--warmup",
        type=int,
        default=30,
        help="honest groups each attacker identity submits before attacking (default rate)",
    )
    parser.add_argument(
        "--identities",
        type=int,
        default=3,
        help="identities an attacker burns at the default rate (each warmed up)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny run: 2 groups, 2 warm-up, 1 identity"
    )
    parser.add_argument("--only", default="", help="comma-separated attack names (default: all)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.warmup, args.identities = 2, 2, 1
    if args.groups < 1 or args.warmup < 0 or args.identities < 1:
        parser.error("--groups and --identities must be >= 1, --warmup >= 0")
    result = run_all(args)
    if args.out:
        args.out.write_text(json.dumps(result, sort_keys=True, indent=1))
    emit(result)


if __name__ == "__main__":
    main()
