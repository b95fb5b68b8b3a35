"""The honest contributor's core: answer one signed assignment with a signed group.

1. verify the assignment's signature under the validator key and that it is
   addressed to this contributor;
2. tokenize the prompt with the policy's tokenizer;
3. generate G completions with the verifiable sampler (noise keyed by this
   contributor's public key, the assignment nonce and seed);
4. commit to each completion's tokens and logprobs and sign its header.

Adversarial workers (``harness/adversaries``) reuse these pieces and change
one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from rollout.backends import GeneratedCompletion, GenerationBackend, GenerationRequest
from verify.envelope import build_envelope
from verify.errors import Reason, VerificationError
from verify.keys import PublicKey, SigningKey
from verify.signed import open_sealed
from verify.types import GroupSubmission, RolloutEnvelope, SignedAssignment, WorkAssignment


class Tokenizer(Protocol):
    """What a contributor needs from a tokenizer (``node.validator.policy.HFTextCodec`` fits)."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]:  # pragma: no cover - protocol
        raise NotImplementedError


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def open_assignment(
    sealed: SignedAssignment, validator: PublicKey, me: PublicKey
) -> WorkAssignment:
    """Step 1."""
    assignment = open_sealed(WorkAssignment, sealed, validator)
    if assignment.contributor_key != me.raw:
        raise VerificationError(
            "assignment is addressed to another contributor",
            reason=Reason.WRONG_SIGNER,
            expected=me.raw,
            computed=assignment.contributor_key,
        )
    return assignment


def generation_request(
    a: WorkAssignment, prompt_ids: Sequence[int], me: PublicKey, stop_token_ids: Sequence[int]
) -> GenerationRequest:
    s = a.sampling
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        group_size=a.group_size,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        sampler_key=me.raw,
        nonce=a.nonce,
        seed=s.seed,
        stop_token_ids=tuple(stop_token_ids),
        sampler=s.sampler,
    )


def honest_request(a: WorkAssignment, me: PublicKey, tokenizer: Tokenizer) -> GenerationRequest:
    """The request an honest contributor makes for ``a``: the prompt as ``tokenizer`` encodes
    it, ending a completion at the assignment's stop tokens (its stopping rule)."""
    return generation_request(a, tokenizer.encode(a.prompt), me, a.stop_token_ids)


def header_fields(
    a: WorkAssignment,
    group_index: int,
    created_at_ms: int,
    *,
    precision: str = "float32",
    backend: str = "transformers",
) -> dict:
    """Every header field the assignment determines (the rest come from the body), and the
    generation ``precision`` and ``backend`` the contributor declares."""
    return dict(
        policy_version=a.policy_version,
        manifest_digest=a.manifest_digest,
        task_id=a.task_id,
        prompt_id=a.prompt_id,
        prompt_digest=a.prompt_digest,
        assignment_id=a.assignment_id,
        nonce=a.nonce,
        sampling=a.sampling,
        group_index=group_index,
        group_size=a.group_size,
        created_at_ms=created_at_ms,
        chunk_size=a.chunk_size,
        precision=precision,
        backend=backend,
    )


def declared(backend: GenerationBackend) -> dict:
    """What a contributor declares about ``backend`` in its headers: precision and engine."""
    return {"precision": getattr(backend, "precision", "float32"), "backend": backend.name}


def sign_completions(
    key: SigningKey,
    a: WorkAssignment,
    completions: Sequence[GeneratedCompletion],
    clock: Callable[[], int] = now_ms,
    *,
    precision: str = "float32",
    backend: str = "transformers",
) -> list[RolloutEnvelope]:
    """Step 4, with the chunk size the assignment fixes."""
    return [
        build_envelope(
            key,
            header_fields(a, c.group_index, clock(), precision=precision, backend=backend),
            c.token_ids,
            c.logprobs,
        )
        for c in completions
    ]


def answer(
    key: SigningKey,
    sealed: SignedAssignment,
    validator: PublicKey,
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    clock: Callable[[], int] = now_ms,
) -> GroupSubmission:
    """Steps 1-4: the honest contributor's whole job for one assignment."""
    a = open_assignment(sealed, validator, key.public)
    completions = backend.generate(honest_request(a, key.public, tokenizer))
    return GroupSubmission(
        a.assignment_id, sign_completions(key, a, completions, clock, **declared(backend))
    )
