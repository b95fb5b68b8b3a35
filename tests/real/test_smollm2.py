"""A real pretrained model end to end: SmolLM2-135M (vocabulary 49,152, chat template) on GSM8K.

One group is generated, committed in 32-token chunks, signed, admitted and
spot-checked by a live validator core; the same rollouts with one late
chunk's logprobs shifted by 0.05 nats are rejected with the chunk named.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from ledger.log import Ledger
from node.config import ValidatorConfig, load
from node.validator.build import load_tolerance
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import StateStore
from rewards.tasks import generate
from rollout.backends import GeneratedCompletion, TransformersBackend
from rollout.oracle import TransformersOracle
from rollout.pretrained import fetched
from rollout.worker import generation_request, open_assignment, sign_completions
from verify.errors import Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import GroupSubmission, canonical_bytes

CHUNK = 32
MIN_TOKENS = 64
CONTRIBUTOR = SigningKey.from_seed(b"\x61" * 32)


def _validator(model, codec, oracle, tmp, name: str) -> Validator:
    """A fresh validator whose entropy and clock are fixed: two of them issue the same first
    assignment (prompt, nonce, seed), so one generated group can be answered to each."""
    cfg = load(
        ValidatorConfig,
        None,
        {
            "assignment.max_tokens": 80,
            "assignment.group_size": 2,
            "assignment.chunk_size": CHUNK,
            "rules.audit_rate": 1.0,
            "audit.pit_min_tokens": 100_000,
        },
    )
    key = SigningKey.from_seed(b"\x60" * 32)
    ledger = Ledger.open(tmp / f"{name}.sqlite", signing_key=key, origin="test/smollm2")
    state = StateStore(tmp / f"{name}.state.sqlite")
    rng = random.Random(7)
    v = Validator(
        cfg,
        key,
        ledger,
        state,
        codec,
        oracle,
        generate("gsm8k", "train", 16),
        PolicyVersions(model_dir_digest(model)),
        load_tolerance(cfg),
        clock=lambda: 1_700_000_000_000,
        entropy=rng.randbytes,
    )
    v.register(CONTRIBUTOR.public.raw, "smollm2-contributor")
    return v


@pytest.fixture(scope="module")
def codec(smollm2) -> HFTextCodec:
    return HFTextCodec(smollm2)


def test_the_fetched_model_is_the_packaged_smollm2(smollm2) -> None:
    record = fetched(smollm2)
    assert record is not None and record.model == "smollm2-135m"
    assert record.vocab_size == 49_152 and 134_000_000 < record.parameters < 135_000_000


def test_prompts_go_through_the_chat_template(codec) -> None:
    ids = codec.encode("What is 2 + 3?")
    text = codec._tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "What is 2 + 3?<|im_end|>" in text


def test_a_long_rollout_is_accepted_and_one_shifted_late_chunk_is_caught(
    smollm2, codec, tmp_path
) -> None:
    oracle = TransformersOracle({0: smollm2})
    honest_v, tamper_v = (
        _validator(smollm2, codec, oracle, tmp_path, n) for n in ("honest", "tamper")
    )
    backend = TransformersBackend(smollm2)
    sealed = honest_v.assign(CONTRIBUTOR.public.raw)
    a = open_assignment(sealed, honest_v.key.public, CONTRIBUTOR.public)
    assert list(a.stop_token_ids) == [codec.eos_token_id] and a.chunk_size == CHUNK
    comps = backend.generate(
        generation_request(a, codec.encode(a.prompt), CONTRIBUTOR.public, a.stop_token_ids)
    )
    longest = max(range(len(comps)), key=lambda g: len(comps[g].token_ids))
    n = len(comps[longest].token_ids)
    assert n >= MIN_TOKENS, f"completions too short to span chunks: {n} tokens"

    group = GroupSubmission(a.assignment_id, sign_completions(CONTRIBUTOR, a, comps, lambda: 1))
    got = open_group_verdict(honest_v.submit(canonical_bytes(group)), honest_v.key.public)
    assert [x.accepted for x in got] == [True, True], [x.reason for x in got]
    assert all(x.audited for x in got)

    # The same rollouts, answered to a validator that issued the same assignment, with the
    # logprobs of the longest completion's last chunk moved 0.05 nats.
    b = open_assignment(
        tamper_v.assign(CONTRIBUTOR.public.raw), tamper_v.key.public, CONTRIBUTOR.public
    )
    assert (b.prompt_id, b.nonce, b.sampling) == (a.prompt_id, a.nonce, a.sampling)
    last = (n - 1) // CHUNK
    forged = []
    for g, c in enumerate(comps):
        lp = np.array(c.logprobs, dtype=np.float32)
        if g == longest:
            tail = lp[last * CHUNK :]
            lp[last * CHUNK :] = np.where(tail <= -0.05, tail + 0.05, tail - 0.05)
        forged.append(completion(g, c.token_ids, lp))
    bad = GroupSubmission(b.assignment_id, sign_completions(CONTRIBUTOR, b, forged, lambda: 1))
    got = open_group_verdict(tamper_v.submit(canonical_bytes(bad)), tamper_v.key.public)
    assert not any(x.accepted for x in got)
    assert Reason(got[longest].reason) is Reason.LOGPROB_MISMATCH
    for v in (honest_v, tamper_v):
        v.ledger.close()
        v.state.close()


def completion(g: int, tokens, logprobs: np.ndarray) -> GeneratedCompletion:
    lp = np.asarray(logprobs, dtype=np.float32)
    lp.setflags(write=False)
    return GeneratedCompletion(g, tuple(tokens), lp, "stop")
