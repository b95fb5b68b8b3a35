"""Spot checks batched across groups: same verdicts as one group at a time, shared forward passes."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from node.validator.commit import Batcher
from node.validator.spot import SpotCheckFailed, SpotJob, spot_check_group, spot_check_jobs
from rollout.oracle import TransformersOracle
from rollout.worker import answer, generation_request, header_fields, open_assignment
from verify.envelope import build_envelope, verify_envelope
from verify.errors import Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.spotcheck import FLOAT32_TOLERANCE
from verify.types import GroupSubmission, canonical_bytes

KEYS = [SigningKey.from_seed(bytes([0x60 + i]) * 32) for i in range(6)]
SECRET = b"\x07" * 32


def test_batcher_gives_each_caller_its_own_result_and_shares_calls() -> None:
    calls: list[list[int]] = []

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        time.sleep(0.05)
        return [x * 10 for x in items]

    b: Batcher[int, int] = Batcher(fn)
    out: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, b.run(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {i: i * 10 for i in range(8)}
    assert sorted(x for c in calls for x in c) == list(range(8))
    assert len(calls) < 8 and b.batches == len(calls) and b.items == 8


def test_batcher_rejects_a_wrong_number_of_results() -> None:
    b: Batcher[int, int] = Batcher(lambda items: [1])
    assert b.run(5) == 1
    with pytest.raises(RuntimeError, match="2 results for 1 items"):
        Batcher(lambda items: [1, 2]).run(5)


def _jobs(make_validator, backend, codec, n: int, tamper: int | None = None) -> list[SpotJob]:
    v = make_validator()
    jobs = []
    for i in range(n):
        key = KEYS[i]
        v.register(key.public.raw, f"c{i}")
        a = open_assignment(v.assign(key.public.raw), v.key.public, key.public)
        prompt = codec.encode(a.prompt)
        comps = backend.generate(generation_request(a, prompt, key.public, [codec.eos_token_id]))
        rollouts = []
        for c in comps:
            lps = np.array(c.logprobs, dtype=np.float32)
            if i == tamper and c.group_index == 1:
                lps[0] -= 0.05
            rollouts.append(verify_envelope(build_envelope(key, header_fields(a, c.group_index, 1),
                                                           c.token_ids, lps, 32)))
        jobs.append(SpotJob(rollouts, prompt, SECRET))
    return jobs


def test_batched_spot_checks_give_each_group_its_own_verdicts(make_validator, backend, codec, tiny_model) -> None:
    jobs = _jobs(make_validator, backend, codec, 5, tamper=2)
    oracle = TransformersOracle({0: tiny_model}, min_prefix_savings=0)
    batched = spot_check_jobs(jobs, oracle, 2, FLOAT32_TOLERANCE)
    alone = [spot_check_group(j.rollouts, j.prompt_ids, TransformersOracle({0: tiny_model}), SECRET, 2,
                              FLOAT32_TOLERANCE) for j in jobs]
    assert len(batched) == len(jobs)
    for j, (got, want) in enumerate(zip(batched, alone, strict=True)):
        assert len(got) == len(want) == len(jobs[j].rollouts)
        for g, w in zip(got, want, strict=True):
            assert isinstance(g, SpotCheckFailed) == isinstance(w, SpotCheckFailed)
            if isinstance(g, SpotCheckFailed):
                assert g.reason is w.reason is Reason.LOGPROB_MISMATCH
                assert j == 2
            else:
                assert g.chunks == w.chunks
                np.testing.assert_allclose(g.recomputed, w.recomputed, atol=1e-5)
                np.testing.assert_allclose(g.pit, w.pit, atol=1e-5)
    # Only the tampered member of the tampered group fails; its neighbours in the batch pass.
    failed = [(j, k) for j, rs in enumerate(batched) for k, r in enumerate(rs) if isinstance(r, SpotCheckFailed)]
    assert failed == [(2, 1)]


def _random_seqs(rng: random.Random, lengths=(0, 1, 2, 5, 9)) -> list[tuple[list[int], int]]:
    seqs = []
    for _ in range(5):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 10))]
        for _ in range(rng.randrange(1, 7)):
            completion = [rng.randrange(3, 60) for _ in range(rng.choice(lengths))]
            seqs.append((prompt + completion, len(prompt)))
    rng.shuffle(seqs)
    return seqs


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_every_forward_layout_matches_one_row_per_sequence(tiny_model, seed) -> None:
    seqs = _random_seqs(random.Random(seed), lengths=(0, 1, 2, 5, 9, 30))
    padded = TransformersOracle({0: tiny_model}, min_prefix_savings=10**9, max_packed_tokens=0)
    shared = TransformersOracle({0: tiny_model}, min_prefix_savings=0, max_batch_tokens=40,
                                max_packed_tokens=0)
    packed = TransformersOracle({0: tiny_model}, max_batch_tokens=40)  # several packed batches
    mixed = TransformersOracle({0: tiny_model}, min_prefix_savings=0, max_packed_tokens=24)
    assert packed.packs(0) and mixed.packs(0) and not padded.packs(0)
    want = padded.logits_batch(0, seqs)
    assert [tuple(x.shape) for x in want] == [(len(ids) - p, x.shape[-1]) for (ids, p), x in zip(seqs, want, strict=True)]
    for oracle in (shared, packed, mixed):
        got = oracle.logits_batch(0, seqs)
        assert [x.shape for x in got] == [x.shape for x in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_a_packed_group_runs_its_prompt_once_and_pads_nothing(tiny_model) -> None:
    prompt = [5, 9, 11, 4]
    seqs = [(prompt + [7 + k] * n, len(prompt)) for k, n in enumerate([3, 1, 4, 0, 2])]
    oracle = TransformersOracle({0: tiny_model})
    assert oracle.packs(0)  # the probe's own forward calls come first
    widths: list[tuple[int, ...]] = []
    hook = oracle.model(0).register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        got = oracle.logits_batch(0, seqs)
    finally:
        hook.remove()
    # one forward call over the prompt and every completion but its last token: 4 + 2 + 0 + 3 + 0 + 1
    assert widths == [(1, 10)]
    assert [x.shape[0] for x in got] == [3, 1, 4, 0, 2]


class IgnoresCustomMasks(torch.nn.Module):
    """A causal LM that drops a 4-D attention mask, as attention kernels without mask support do."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, attention_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.inner(attention_mask=attention_mask, **kwargs)


def test_a_model_that_ignores_packed_masks_is_not_packed(tiny_model) -> None:
    from rollout.backends import load_causal_lm

    seqs = _random_seqs(random.Random(6))
    oracle = TransformersOracle({0: IgnoresCustomMasks(load_causal_lm(tiny_model, "cpu", None))})
    assert not oracle.packs(0)
    want = TransformersOracle({0: tiny_model}, max_packed_tokens=0).logits_batch(0, seqs)
    for g, w in zip(oracle.logits_batch(0, seqs), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # and the packed layout itself is what the probe rejected: it would have answered wrongly
    wrong: list[torch.Tensor | None] = [None] * 3
    probe = [([5, 9, 11, 7, 7, 7], 3), ([5, 9, 11, 8, 8], 3), ([5, 9, 11, 6, 6, 6], 3)]
    oracle._run_packed(oracle.model(0), probe, [[0, 1, 2]], wrong)
    right = TransformersOracle({0: tiny_model}, max_packed_tokens=0).logits_batch(0, probe)
    assert max(float((g - w).abs().max()) for g, w in zip(wrong, right, strict=True) if g is not None) > 1e-3


def test_a_sliding_window_bounds_the_packed_rows(tiny_model) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=6, attn_implementation="sdpa")).eval()
    oracle = TransformersOracle({0: model})
    assert oracle.packs(0) and oracle._packs[0] == 6
    rng = random.Random(7)
    prompt = [rng.randrange(3, 60) for _ in range(3)]
    seqs = [(prompt + [rng.randrange(3, 60) for _ in range(n)], 3) for n in (2, 3, 9)]  # packed: 14 slots
    want = TransformersOracle({0: model}, max_packed_tokens=0, min_prefix_savings=10**9).logits_batch(0, seqs)
    for g, w in zip(oracle.logits_batch(0, seqs), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # packed anyway, the row's mask would let the last completion see past the window
    wide: list[torch.Tensor | None] = [None] * len(seqs)
    oracle._run_packed(oracle.model(0), seqs, [[0, 1, 2]], wide)
    assert float((wide[2] - want[2]).abs().max()) > 1e-3  # type: ignore[operator]


def test_packing_is_probed_once_per_loaded_version(tiny_model, other_model) -> None:
    oracle = TransformersOracle({0: tiny_model, 1: other_model}, max_versions=1)
    calls: list[int] = []
    probe = oracle._packing_matches
    oracle._packing_matches = lambda m: calls.append(1) or probe(m)  # type: ignore[method-assign]
    assert oracle.packs(0) and oracle.packs(0) and calls == [1]
    oracle.model(1)  # evicts version 0, and what was learnt of its model
    assert oracle.packs(1) and oracle.packs(0) and calls == [1, 1, 1]
    with pytest.raises(ValueError, match="max_packed_tokens"):
        TransformersOracle({0: tiny_model}, max_packed_tokens=-1)


class SlowOracle:
    """Delegates to an oracle, taking long enough per call that concurrent audits queue up."""

    def __init__(self, inner: TransformersOracle) -> None:
        self.inner = inner
        self.calls = 0

    def logits_batch(self, version, seqs):  # type: ignore[no-untyped-def]
        self.calls += 1
        time.sleep(0.2)
        return self.inner.logits_batch(version, seqs)


def test_concurrent_submissions_share_spot_check_passes(make_validator, backend, codec, tiny_model) -> None:
    v = make_validator()
    v.oracle = SlowOracle(TransformersOracle({0: tiny_model}))
    groups: list[GroupSubmission] = []
    for key in KEYS:
        v.register(key.public.raw, "c")
        groups.append(answer(key, v.assign(key.public.raw), v.key.public, backend, codec))
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, v.submit(canonical_bytes(groups[i]))))
               for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(groups)):
        out = open_group_verdict(results[i], v.key.public)
        assert all(x.accepted and x.audited for x in out)
    assert v.metrics["audit/groups"] == len(groups)
    assert v.metrics["audit/batches"] == v.oracle.calls < len(groups)
