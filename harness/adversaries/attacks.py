"""The adversary catalogue. Each class documents attack, parameters and expected outcome."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from harness.adversaries.base import Context, Honest, completion, register_strategy
from rollout.backends import GeneratedCompletion, TransformersBackend
from verify.errors import Reason
from verify.types import GroupSubmission, SignedAssignment, WorkAssignment, canonical_bytes

SPOT = frozenset(
    {Reason.LOGPROB_MISMATCH, Reason.SAMPLER_REPLAY_MISMATCH, Reason.TOKEN_OUTSIDE_SUPPORT}
)
HEADER = frozenset({Reason.ASSIGNMENT_MISMATCH, Reason.WRONG_PROMPT})


@register_strategy
@dataclass
class TamperedLogprobs:
    """Samples honestly, then shifts the committed logprob of ``tokens`` tokens by ``shift`` nats
    (towards 0: claims the old policy liked the token more, inflating importance weights in its
    favour). ``where`` picks the tokens: ``"start"`` (the first ones) or ``"last-chunk"`` (the
    first ``tokens`` of each completion's last commitment chunk, late in a long completion,
    where a validator that compared only some chunks would not look). Expect LOGPROB_MISMATCH
    when audited, for any shift above the tolerance."""

    shift: float = 0.05
    tokens: int = 3
    where: str = "start"
    name: ClassVar[str] = "tampered-logprobs"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.LOGPROB_MISMATCH})
    plain_generation: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.where not in ("start", "last-chunk"):
            raise ValueError(f"where must be 'start' or 'last-chunk', not {self.where!r}")

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        out = []
        for c in ctx.generate(a):
            lp = np.array(c.logprobs, dtype=np.float32)
            first = 0 if self.where == "start" else (len(lp) - 1) // a.chunk_size * a.chunk_size
            sl = slice(first, min(first + self.tokens, len(lp)))
            lp[sl] = np.where(lp[sl] <= -self.shift, lp[sl] + self.shift, lp[sl] - self.shift)
            out.append(completion(c.group_index, c.token_ids, lp))
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, out)))


@register_strategy
@dataclass
class LowPrecisionCopy:
    """Generates with a cheaper copy of the assigned policy, ``dtype`` ``"bfloat16"`` (weights
    and activations) or ``"int8"`` (linear weights rounded to int8), while declaring the
    float32 generation it was assigned. Its committed logprobs are the copy's own, so the logprob
    comparison sees the copy's distance from the policy: expect LOGPROB_MISMATCH (or
    SAMPLER_REPLAY_MISMATCH where a near-tie resolved differently) when audited, because a float32
    declaration is held to the float32 bound."""

    dtype: str = "bfloat16"
    name: ClassVar[str] = "low-precision-copy"
    expect: ClassVar[frozenset[Reason]] = frozenset(
        {Reason.LOGPROB_MISMATCH, Reason.SAMPLER_REPLAY_MISMATCH}
    )
    _copies: dict[int, TransformersBackend] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "int8"):
            raise ValueError(f"dtype must be 'bfloat16' or 'int8', not {self.dtype!r}")

    def _copy(self, ctx: Context, version: int) -> TransformersBackend:
        if version not in self._copies:
            self._copies.clear()  # one version at a time: a copy of a 135M model is 270-540 MB
            source = getattr(ctx.backend, "model", None)
            if source is None:
                raise ValueError("low-precision-copy needs a transformers backend to copy")
            self._copies[version] = TransformersBackend(cheaper_copy(source, self.dtype))
        return self._copies[version]

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = self._copy(ctx, a.policy_version).generate(ctx.request(a))
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, comps)))


@torch.no_grad()
def cheaper_copy(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A copy of ``model`` in bfloat16, or with every linear layer's weights rounded to int8
    (symmetric, one scale per output row, as weight-only int8 inference engines store them)."""
    clone = copy.deepcopy(model).eval()
    if dtype == "bfloat16":
        return clone.to(torch.bfloat16)
    for module in clone.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
            w.copy_((w / scale).round().clamp(-127, 127) * scale)
    return clone


@register_strategy
@dataclass
class FabricatedTokens:
    """Writes ``text`` at the start of every completion instead of sampling it, and commits the
    policy's honest logprobs for those tokens (so the logprob comparison passes). Expect
    SAMPLER_REPLAY_MISMATCH or TOKEN_OUTSIDE_SUPPORT when audited."""

    text: str = "100"
    name: ClassVar[str] = "fabricated-tokens"
    expect: ClassVar[frozenset[Reason]] = frozenset(
        {Reason.SAMPLER_REPLAY_MISMATCH, Reason.TOKEN_OUTSIDE_SUPPORT}
    )
    plain_generation: ClassVar[bool] = True

    def forge(self, ctx: Context, a, comps: list[GeneratedCompletion]) -> list[GeneratedCompletion]:  # type: ignore[no-untyped-def]
        """The planted text, cut to obey the assignment's stopping rule (it ends at a stop
        token, within ``max_tokens``), so only the sampler replay can tell."""
        stops = ctx.stops(a)
        bos = getattr(ctx.tokenizer, "bos_token_id", None)
        planted = [t for t in ctx.tokenizer.encode(self.text) if t != bos and t not in stops]
        room = a.sampling.max_tokens - len(stops[:1])
        planted = planted[:room] + stops[:1]
        return [completion(c.group_index, planted, ctx.honest_logprobs(a, planted)) for c in comps]

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        return ctx.remember(
            GroupSubmission(a.assignment_id, ctx.sign(a, self.forge(ctx, a, ctx.generate(a))))
        )


@register_strategy
@dataclass
class SplicedTokens:
    """Swaps the completions of group members g and g+1 (each signed under the other's index),
    keeping their logprobs. Expect SAMPLER_REPLAY_MISMATCH when audited (the noise is per index)."""

    name: ClassVar[str] = "spliced-tokens"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.SAMPLER_REPLAY_MISMATCH})
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = ctx.generate(a)
        n = len(comps)
        out = [
            completion(g, comps[(g + 1) % n].token_ids, comps[(g + 1) % n].logprobs)
            for g in range(n)
        ]
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, out)))


@register_strategy
@dataclass
class WrongModel:
    """Generates with another (weaker, older or cheaper) model in ``model_dir`` while claiming the
    assigned policy version. Expect LOGPROB_MISMATCH when audited."""

    model_dir: str = ""
    name: ClassVar[str] = "wrong-model"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.LOGPROB_MISMATCH})
    _backend: TransformersBackend | None = field(default=None, repr=False)

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        if self._backend is None:
            self._backend = TransformersBackend(self.model_dir)
        a = ctx.assignment(sealed)
        comps = self._backend.generate(ctx.request(a))
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, comps)))


@register_strategy
@dataclass
class StaleVersion:
    """Claims an older policy version than the one assigned (to pass off cached rollouts).
    Expect ASSIGNMENT_MISMATCH: the signed header contradicts the signed assignment (slashed)."""

    lag: int = 1
    name: ClassVar[str] = "stale-version"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.ASSIGNMENT_MISMATCH})
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        from rollout.worker import header_fields
        from verify.envelope import build_envelope

        a = ctx.assignment(sealed)
        envs = [
            build_envelope(
                ctx.key,
                {
                    **header_fields(a, c.group_index, 1),
                    "policy_version": a.policy_version + self.lag,
                },
                c.token_ids,
                c.logprobs,
            )
            for c in ctx.generate(a)
        ]
        return ctx.remember(GroupSubmission(a.assignment_id, envs))


@register_strategy
@dataclass
class Greedy:
    """Decodes greedily (cheaper, higher reward) but claims temperature 1 and commits the policy's
    honest temperature-1 logprobs of the greedy tokens. Expect SAMPLER_REPLAY_MISMATCH."""

    name: ClassVar[str] = "greedy"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.SAMPLER_REPLAY_MISMATCH})

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = [
            completion(c.group_index, c.token_ids, ctx.honest_logprobs(a, list(c.token_ids)))
            for c in ctx.generate(a, temperature=0.0)
        ]
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, comps)))


@register_strategy
@dataclass
class WrongTemperature:
    """Samples at ``temperature`` with the verifiable sampler's own noise, claims the assigned
    temperature, and commits honest logprobs under the claim. Expect SAMPLER_REPLAY_MISMATCH."""

    temperature: float = 0.5
    name: ClassVar[str] = "wrong-temperature"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.SAMPLER_REPLAY_MISMATCH})

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = [
            completion(c.group_index, c.token_ids, ctx.honest_logprobs(a, list(c.token_ids)))
            for c in ctx.generate(a, temperature=self.temperature)
        ]
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, comps)))


@register_strategy
@dataclass
class Replay:
    """Answers a new assignment with a group it submitted before (no generation cost).
    Expect ASSIGNMENT_MISMATCH or WRONG_PROMPT (the old headers name the old assignment)."""

    name: ClassVar[str] = "replay"
    expect: ClassVar[frozenset[Reason]] = HEADER

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        if not ctx.memory:
            return Honest().answer(ctx, sealed)
        return canonical_bytes(GroupSubmission(a.assignment_id, ctx.memory[0].envelopes))


@register_strategy
@dataclass
class CrossKeyCopy:
    """A Sybil identity copies the tokens and logprobs of a group its colluder generated (shared
    memory) and signs them as its own answer. A repeated completion is always audited: expect
    LOGPROB_MISMATCH or SAMPLER_REPLAY_MISMATCH (the noise is keyed by the signer)."""

    name: ClassVar[str] = "cross-key-copy"
    expect: ClassVar[frozenset[Reason]] = SPOT

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        pool: list[GroupSubmission] = ctx.shared.setdefault("groups", [])
        a = ctx.assignment(sealed)
        if not pool:
            raw = Honest().answer(ctx, sealed)
            pool.append(ctx.memory[-1])
            return raw
        donor = pool[-1]
        comps = [
            completion(
                g,
                np.frombuffer(e.body.token_ids, "<u4").tolist(),
                np.frombuffer(e.body.logprobs, "<f4"),
            )
            for g, e in enumerate(donor.envelopes[: a.group_size])
        ]
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, comps)))


@register_strategy
@dataclass
class CherryPick:
    """Withholds the worst-looking group members (the ones it would rather the trainer not see).
    ``drop`` members are left out. Expect MISSING_GROUP_MEMBER (not slashed: indistinguishable
    from a crash, but the group never reaches the trainer)."""

    drop: int = 1
    name: ClassVar[str] = "cherry-pick"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.MISSING_GROUP_MEMBER})
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        envs = ctx.sign(a, ctx.generate(a))
        keep = envs[: max(1, len(envs) - self.drop)]
        return ctx.remember(GroupSubmission(a.assignment_id, keep))


@register_strategy
@dataclass
class WrongPrompt:
    """Answers an easier prompt it prefers and says so in the signed header.
    Expect WRONG_PROMPT (slashed with the two signed documents as evidence)."""

    prompt_id: str = "train/0"
    name: ClassVar[str] = "wrong-prompt"
    expect: ClassVar[frozenset[Reason]] = frozenset({Reason.WRONG_PROMPT})
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        from rollout.worker import header_fields
        from verify.envelope import build_envelope

        a = ctx.assignment(sealed)
        envs = [
            build_envelope(
                ctx.key,
                {
                    **header_fields(a, c.group_index, 1),
                    "prompt_id": self.prompt_id + ("x" if self.prompt_id == a.prompt_id else ""),
                },
                c.token_ids,
                c.logprobs,
            )
            for c in ctx.generate(a)
        ]
        return ctx.remember(GroupSubmission(a.assignment_id, envs))


@register_strategy
@dataclass
class Poisoning:
    """Steers the policy towards answering ``text`` by planting it (with honest logprobs) in every
    completion. Caught as FabricatedTokens when audited; unaudited groups slip through and their
    influence is bounded by per-contributor robust aggregation. Expect "bounded"."""

    text: str = "0"
    name: ClassVar[str] = "poisoning"
    expect: ClassVar[str] = "bounded"
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        return FabricatedTokens(self.text).answer(ctx, sealed)


@register_strategy
@dataclass
class GradientInflation:
    """Keeps the first ``keep`` fraction of the group as sampled and fills the rest with
    ``max_tokens`` random non-special tokens, committing the policy's honest logprobs for them.
    The validator scores the filler 0, so whenever a sampled member is right the group trains
    with a negative advantage on tokens of probability ~0: the largest per-token gradients the
    loss allows, pointing nowhere useful. Under a plain mean this contributor's gradient
    dominates the update and the global clip shrinks the honest signal with it. Caught as
    SAMPLER_REPLAY_MISMATCH / TOKEN_OUTSIDE_SUPPORT when audited; unaudited groups are bounded
    by centered clipping. Expect "bounded".

    ``alphabet`` draws the filler from the tokens of those characters instead of the whole
    vocabulary: ``"0123456789"`` aims it at the tokens answers are written in, as the demo
    policy's 101-token vocabulary does by itself. ``shift`` lowers the committed logprobs by
    that many nats (caught by the logprob comparison too), which puts the filler's importance
    weight at the loss's cap."""

    keep: float = 0.5
    alphabet: str = ""
    shift: float = 0.0
    name: ClassVar[str] = "gradient-inflation"
    expect: ClassVar[str] = "bounded"
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = ctx.generate(a)
        kept = max(1, int(round(self.keep * len(comps))))
        special = {
            getattr(ctx.tokenizer, n, None)
            for n in ("eos_token_id", "bos_token_id", "pad_token_id")
        }
        if self.alphabet:
            vocab = sorted({t for ch in self.alphabet for t in ctx.tokenizer.encode(ch)} - special)
        else:
            size = int(getattr(ctx.tokenizer, "vocab_size", 0))
            vocab = [t for t in range(size) if t not in special]
        if not vocab:
            raise ValueError(
                "gradient-inflation has no filler tokens: its alphabet encodes to special "
                "tokens only, or the tokenizer has no vocab_size"
            )
        out = list(comps[:kept])
        for c in comps[kept:]:
            junk = [int(t) for t in ctx.rng.choice(vocab, size=a.sampling.max_tokens)]
            lp = ctx.honest_logprobs(a, junk) - self.shift
            out.append(completion(c.group_index, junk, lp))
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, out)))


@register_strategy
@dataclass
class BudgetExhaustion:
    """Teaches the policy a preamble that leaves no room for long answers, with samples the
    validator scores honestly. It reads the answer ``y`` from the public problem
    (``Context.problems``). Where ``preamble + y`` fills the assignment's ``max_tokens``
    exactly (a two-digit sum after the default preamble), half the group plants that text
    ("Sure! The sum of the two numbers is 57") and the validator scores it 1. The other half
    plants a wrong number, scored 0, so the rewarded members get advantage +1.

    The committed logprobs decide where that credit lands. The rewarded members are committed
    ``shift`` nats below the policy's own logprobs, so each token's importance weight
    ``min(pi / mu, cap)`` sits at the cap. The wrong numbers are committed at logprob 0, so
    their weight is ``pi``, near 0. The same preamble is taught at every such prompt, and
    a policy that learns it has no room left for a three-digit answer: "...numbers is 13",
    cut at ``max_tokens``, scores 0.

    Elsewhere (an unknown problem, an answer that does not fill the budget, rewards that do
    not come out as planned) it submits its honest group. It always generates that group,
    so it answers at an honest contributor's pace. Caught as LOGPROB_MISMATCH (or
    SAMPLER_REPLAY_MISMATCH / TOKEN_OUTSIDE_SUPPORT) when audited. Unaudited, the loss itself
    bounds its pull (the importance-weight cap, group-normalised advantages, each
    contributor's token mean) and centered clipping bounds it again. Expect "bounded"."""

    preamble: str = "Sure! The sum of the two numbers is "
    shift: float = 3.0
    name: ClassVar[str] = "budget-exhaustion"
    expect: ClassVar[str] = "bounded"
    plain_generation: ClassVar[bool] = True

    def _plant(
        self, ctx: Context, a: WorkAssignment, answer: str, comps: list[GeneratedCompletion]
    ) -> list[GeneratedCompletion] | None:
        if not answer.lstrip("-").isdigit():
            return None
        stops = ctx.stops(a)
        skip = {getattr(ctx.tokenizer, "bos_token_id", None), *stops}

        def encode(text: str) -> list[int]:
            return [t for t in ctx.tokenizer.encode(text) if t not in skip]

        rewarded = encode(self.preamble + answer)
        if len(rewarded) != a.sampling.max_tokens:
            return None
        wrong = "".join(str((int(ch) + 5) % 10) if ch.isdigit() else ch for ch in answer)
        zero = encode(wrong) + stops[:1]
        forged = ctx.honest_logprobs(a, rewarded) - self.shift
        zero_lp = np.zeros(len(zero), np.float32)
        return [
            completion(c.group_index, rewarded, forged)
            if i % 2
            else completion(c.group_index, zero, zero_lp)
            for i, c in enumerate(comps)
        ]

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = ctx.generate(a)
        problem = ctx.problems.get(a.prompt_id)
        planted = None if problem is None else self._plant(ctx, a, problem.answer, comps)
        if planted is not None and ctx.own_rewards(a, planted) == [
            float(i % 2) for i in range(len(planted))
        ]:
            comps = planted
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, comps)))


@register_strategy
@dataclass
class RewardHacker:
    """Plants completions built to fool a reward function (several candidate answers, a huge
    output). The validator's reward scores them 0 or low; audited ones fail replay.
    Expect SAMPLER_REPLAY_MISMATCH / TOKEN_OUTSIDE_SUPPORT when audited, reward ~0 otherwise."""

    text: str = "1 2 3 4 5 6 7 8 9 10 11 12"
    name: ClassVar[str] = "reward-hacker"
    expect: ClassVar[frozenset[Reason]] = FabricatedTokens.expect
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        return FabricatedTokens(self.text).answer(ctx, sealed)


@register_strategy
@dataclass
class Intermittent:
    """Cheats with ``inner`` on a fraction ``f`` of assignments, honest otherwise, hoping the
    cheats fall outside the audited set. Expect the inner strategy's reasons when audited;
    detection probability over n groups is 1 - (1 - p f)^n (``prooftrain audit-rate``)."""

    f: float = 0.3
    inner: str = "tampered-logprobs"
    name: ClassVar[str] = "intermittent"
    expect: ClassVar[str] = "inner"
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes | None:
        from harness.adversaries.base import make_strategy

        if ctx.rng.random() < self.f:
            return make_strategy(self.inner).answer(ctx, sealed)
        return Honest().answer(ctx, sealed)


@register_strategy
@dataclass
class MalformedFlood:
    """Sends garbage: random bytes, truncated and bit-flipped groups. Expect MALFORMED, TRUNCATED,
    TRAILING_BYTES or BAD_SIGNATURE with nothing recorded and the node unharmed."""

    size: int = 256
    name: ClassVar[str] = "malformed-flood"
    expect: ClassVar[frozenset[Reason]] = frozenset(
        {
            Reason.MALFORMED,
            Reason.TRUNCATED,
            Reason.TRAILING_BYTES,
            Reason.BAD_SIGNATURE,
            Reason.COMMITMENT_MISMATCH,
            Reason.INCONSISTENT,
        }
    )

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        raw = bytearray(Honest().answer(ctx, sealed))
        choice = int(ctx.rng.integers(3))
        if choice == 0:
            return bytes(ctx.rng.bytes(self.size))
        if choice == 1:
            return bytes(raw[: int(ctx.rng.integers(1, len(raw)))])
        pos = int(ctx.rng.integers(len(raw) // 2, len(raw)))
        raw[pos] ^= 0x40
        return bytes(raw)
