"""Transformers generation and teacher-forced recomputation agree on the committed logprobs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.backends import (
    GenerationRequest,
    TransformersBackend,
    available_backends,
    make_backend,
)
from rollout.oracle import TransformersOracle, UnknownPolicyVersion
from verify.errors import ConfigError, Reason, SpotCheckError
from verify.samplers import sampler_named
from verify.sampling import (
    pit_randomizer,
    pit_uniformity_test,
    pit_values,
    process_logits,
    support_check,
)
from verify.spotcheck import (
    BFLOAT16_TOLERANCE,
    FLOAT32_TOLERANCE,
    OracleRequest,
    Tolerance,
    compare_chunk,
)

torch.set_num_threads(1)
EOS = 1
VOCAB = 256
KEY = bytes(range(32))
NONCE = b"\x42" * 32
PROMPT = (0, 17, 23, 99, 5, 64, 3)


def _tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # logits with std ~4: peaked, LM-like distributions
    return model.eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    _tiny_llama(0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def backend(model_dir):
    return TransformersBackend(model_dir, dtype="float32")


def _request(temperature=1.0, top_k=0, top_p=1.0, group=8, max_tokens=64, seed=13):
    return GenerationRequest(
        PROMPT,
        group,
        temperature,
        top_k,
        top_p,
        max_tokens,
        KEY,
        NONCE,
        seed,
        stop_token_ids=(EOS,),
    )


def _oracle_requests(request, completions):
    return [
        OracleRequest(
            request.prompt_ids + c.token_ids,
            len(request.prompt_ids),
            request.temperature,
            request.top_k,
            request.top_p,
        )
        for c in completions
    ]


def test_completions_are_well_formed_and_deterministic(backend):
    request = _request()
    first = backend.generate(request)
    assert [c.group_index for c in first] == list(range(8))
    lengths = {len(c.token_ids) for c in first}
    assert len(lengths) > 1, "want completions of different lengths for the padding tests"
    for c in first:
        assert c.logprobs.dtype == np.float32 and c.logprobs.shape == (len(c.token_ids),)
        assert not c.logprobs.flags.writeable
        assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == EOS)
        assert EOS not in c.token_ids[:-1] and len(c.token_ids) <= 64
    again = backend.generate(request)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    other = backend.generate(_request(seed=12))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.0, 0, 1.0)])
@pytest.mark.parametrize("layout", ["packed", "left", "right"])
def test_committed_logprobs_equal_recomputation_fp32(backend, model_dir, params, layout):
    request = _request(*params)
    completions = backend.generate(request)
    requests = _oracle_requests(request, completions)
    packed = layout == "packed"
    oracle = TransformersOracle(
        {3: model_dir},
        dtype="float32",
        padding_side="left" if packed else layout,
        max_packed_tokens=4096 if packed else 0,
    )
    assert oracle.packs(3) == packed
    batched = oracle.logprobs_batch(3, requests)  # batch of 8: one packed row, or 8 padded ones
    singles = [oracle.logprobs(3, r.input_ids, r.prompt_len, *params) for r in requests]
    worst = 0.0
    for c, b, s in zip(completions, batched, singles, strict=True):
        worst = max(worst, float(np.abs(b - c.logprobs).max()), float(np.abs(s - c.logprobs).max()))
    print(
        f"fp32 generation vs fp32 recomputation ({layout} layout, {params}): "
        f"max abs diff {worst:.2e}"
    )
    assert worst <= 1e-5
    if params[0] == 0.0:
        assert all(np.all(c.logprobs == 0.0) for c in completions)


def test_generation_batch_size_does_not_change_a_completion(backend):
    alone = backend.generate(_request(group=1))[0]
    in_group = backend.generate(_request(group=8))[0]
    assert alone.token_ids == in_group.token_ids
    assert np.abs(alone.logprobs - in_group.logprobs).max() <= 1e-5
    short = backend.generate(_request(group=2, max_tokens=1))
    assert all(len(c.token_ids) == 1 for c in short)


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_a_batch_of_requests_generates_what_each_would_alone(backend, model_dir, params):
    # prompts of different lengths (left padding), other nonces, seeds and keys per request
    prompts = [PROMPT, PROMPT[:3], (5, 9, 200, 31, 7, 7, 7, 7, 12, 40, 41), PROMPT[2:]]
    requests = [
        dataclasses.replace(
            _request(*params, group=4, max_tokens=24, seed=20 + i),
            prompt_ids=p,
            nonce=bytes([i]) * 32,
            sampler_key=bytes([i + 1]) * 32,
        )
        for i, p in enumerate(prompts)
    ]
    batched = backend.generate_batch(requests)
    assert len(batched) == len(requests)
    for request, group in zip(requests, batched, strict=True):
        alone = backend.generate(request)
        assert [c.group_index for c in group] == list(range(4))
        assert [c.token_ids for c in group] == [c.token_ids for c in alone]
        assert [c.finish_reason for c in group] == [c.finish_reason for c in alone]
        for a, b in zip(group, alone, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=FLOAT32_TOLERANCE.token_abs)
        # and the validator's recomputation accepts them (same committed definition)
        oracle = TransformersOracle({0: model_dir}, dtype="float32")
        for c, recomputed in zip(
            group, oracle.logprobs_batch(0, _oracle_requests(request, group)), strict=True
        ):
            np.testing.assert_allclose(c.logprobs, recomputed, atol=FLOAT32_TOLERANCE.token_abs)
    assert len({c.token_ids for g in batched for c in g}) > 8


def test_unshared_prefill_generates_what_the_shared_one_does(backend, model_dir):
    """``share_prefill=False`` prefills every completion's prompt on its own row (as a
    generator without prefix sharing does): the same completions, more prefill work."""
    unshared = TransformersBackend(backend.model, share_prefill=False)
    prompts = [PROMPT, PROMPT[:3], (5, 9, 200, 31, 7, 7, 7, 7, 12, 40, 41)]
    requests = [
        dataclasses.replace(_request(group=4, max_tokens=16, seed=40 + i), prompt_ids=p)
        for i, p in enumerate(prompts)
    ]
    prefilled: list[int] = []
    hook = unshared.model.register_forward_pre_hook(
        lambda _m, _a, kw: (
            prefilled.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    try:
        batched, alone = unshared.generate_batch(requests), unshared.generate(requests[0])
    finally:
        hook.remove()
    assert prefilled == [3 * 4, 4]  # a prompt row per completion, in a batch and alone
    for got, shared in [
        *zip(batched, backend.generate_batch(requests), strict=True),
        (alone, backend.generate(requests[0])),
    ]:
        assert [c.token_ids for c in got] == [c.token_ids for c in shared]
        for a, b in zip(got, shared, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=FLOAT32_TOLERANCE.token_abs)


def test_a_batch_must_share_sampling_and_length(backend):
    with pytest.raises(ValueError, match="batch_key"):
        backend.generate_batch([_request(), _request(temperature=0.7)])
    with pytest.raises(ValueError, match="batch_key"):
        backend.generate_batch([])
    assert [c.token_ids for c in backend.generate_batch([_request()])[0]] == [
        c.token_ids for c in backend.generate(_request())
    ]


def test_small_batches_split_by_token_budget(model_dir, backend):
    request = _request()
    completions = backend.generate(request)
    requests = _oracle_requests(request, completions)
    whole = TransformersOracle({0: model_dir}, dtype="float32").logprobs_batch(0, requests)
    split = TransformersOracle({0: model_dir}, dtype="float32", max_batch_tokens=60).logprobs_batch(
        0, requests
    )
    for a, b in zip(whole, split, strict=True):
        assert np.abs(a - b).max() <= 1e-5


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.0, 0, 1.0)])
def test_replay_and_support_accept_every_honest_token(backend, model_dir, params):
    request = _request(*params)
    oracle = TransformersOracle({0: model_dir}, dtype="float32")
    for c in backend.generate(request):
        logits = oracle.completion_logits(0, request.prompt_ids + c.token_ids, len(PROMPT))
        sampler = sampler_named(request.sampler)
        uniforms = sampler.randomness(
            [(KEY, NONCE, request.seed, c.group_index, range(len(c.token_ids)))], VOCAB
        )
        stats = sampler.replay(c.token_ids, logits, *params, uniforms, slack=1e-4)
        assert stats.tokens == len(c.token_ids)
        support_check(c.token_ids, logits, *params)


def test_replay_rejects_a_substituted_token(backend, model_dir):
    request = _request()
    c = backend.generate(request)[2]
    oracle = TransformersOracle({0: model_dir}, dtype="float32")
    logits = oracle.completion_logits(0, request.prompt_ids + c.token_ids, len(PROMPT))
    sampler = sampler_named(request.sampler)
    uniforms = sampler.randomness([(KEY, NONCE, request.seed, 2, range(len(c.token_ids)))], VOCAB)
    forged = list(c.token_ids)
    t = len(forged) // 2
    forged[t] = (
        int(np.argsort(logits[t])[-2])
        if forged[t] == int(np.argmax(logits[t]))
        else int(np.argmax(logits[t]))
    )
    with pytest.raises(SpotCheckError) as info:
        sampler.replay(forged, logits, 1.0, 0, 1.0, uniforms, slack=1e-4)
    assert info.value.reason is Reason.SAMPLER_REPLAY_MISMATCH and info.value.position == t
    # The uniforms of another group member do not replay this completion either.
    wrong = sampler.randomness([(KEY, NONCE, request.seed, 3, range(len(c.token_ids)))], VOCAB)
    with pytest.raises(SpotCheckError):
        sampler.replay(c.token_ids, logits, 1.0, 0, 1.0, wrong, slack=1e-4)


def test_wrong_policy_version_fails_the_spot_check(backend, model_dir):
    request = _request()
    completions = backend.generate(request)
    oracle = TransformersOracle({0: model_dir, 1: _tiny_llama(1)}, dtype="float32")
    claimed = completions[0].logprobs
    recomputed = oracle.logprobs_batch(1, _oracle_requests(request, completions[:1]))[0]
    with pytest.raises(SpotCheckError) as info:
        compare_chunk(claimed, recomputed, Tolerance(1e-3, 1e-4), 0)
    assert info.value.reason is Reason.LOGPROB_MISMATCH
    with pytest.raises(UnknownPolicyVersion):
        oracle.logprobs(7, PROMPT + (5,), len(PROMPT), 1.0, 0, 1.0)


def test_bf16_vs_fp32_discrepancy(model_dir):
    """bf16 generation recomputed in fp32, and fp32 generation recomputed in bf16."""
    request = _request(max_tokens=64)
    fp32 = TransformersOracle({0: model_dir}, dtype="float32")
    bf16 = TransformersOracle({0: model_dir}, dtype="bfloat16")
    cases = [
        ("bf16 gen -> fp32 oracle", "bfloat16", fp32),
        ("fp32 gen -> bf16 oracle", "float32", bf16),
    ]
    for label, gen_dtype, oracle in cases:
        completions = TransformersBackend(model_dir, dtype=gen_dtype).generate(request)
        recomputed = oracle.logprobs_batch(0, _oracle_requests(request, completions))
        diff = np.concatenate(
            [np.abs(r - c.logprobs) for r, c in zip(recomputed, completions, strict=True)]
        )
        chunk_means = [
            float(np.abs(r - c.logprobs)[i : i + 32].mean())
            for r, c in zip(recomputed, completions, strict=True)
            for i in range(0, len(c.token_ids), 32)
        ]
        print(
            f"{label}: {diff.size} tokens, max abs diff {diff.max():.4f}, "
            f"mean {diff.mean():.4f}, p99 {np.quantile(diff, 0.99):.4f}, "
            f"worst chunk mean {max(chunk_means):.4f}"
        )
        assert diff.max() > 1e-4  # bf16 noise is real, far above fp32 noise
        for r, c in zip(recomputed, completions, strict=True):
            compare_chunk(c.logprobs, r, BFLOAT16_TOLERANCE, 0)


def test_pit_flags_greedy_generation_claimed_as_temperature_one(backend, model_dir):
    oracle = TransformersOracle({0: model_dir}, dtype="float32")

    def pooled_pit(temperature: float, seeds: range) -> np.ndarray:
        values = []
        for seed in seeds:
            request = _request(temperature=temperature, max_tokens=64, seed=seed)
            completions = backend.generate(request)
            for c in completions:
                logits = oracle.completion_logits(0, PROMPT + c.token_ids, len(PROMPT))
                label = bytes([seed, c.group_index])
                values.append(
                    pit_values(
                        c.token_ids,
                        process_logits(logits, 1.0, 0, 1.0),
                        pit_randomizer(KEY, label, len(c.token_ids)),
                    )
                )
        return np.concatenate(values)

    honest = pooled_pit(1.0, range(3))
    assert pit_uniformity_test(honest, alpha=1e-3).n >= 300
    greedy = pooled_pit(0.0, range(3))
    with pytest.raises(SpotCheckError) as info:
        pit_uniformity_test(greedy, alpha=1e-3)
    assert info.value.reason is Reason.SAMPLING_DISTRIBUTION


def test_registry(model_dir):
    assert "transformers" in available_backends()
    assert isinstance(make_backend("transformers", model=model_dir), TransformersBackend)
    with pytest.raises(ConfigError):
        make_backend("no-such-backend")
    with pytest.raises(ConfigError):
        TransformersBackend(model_dir, dtype="float8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_generation_vs_cpu_recomputation(model_dir):
    """Cross-hardware honest noise: CUDA generation, CPU float32 recomputation."""
    request = _request()
    cpu = TransformersOracle({0: model_dir}, dtype="float32")
    for dtype in ("float32", "bfloat16"):
        completions = TransformersBackend(model_dir, device="cuda", dtype=dtype).generate(request)
        recomputed = cpu.logprobs_batch(0, _oracle_requests(request, completions))
        diff = np.concatenate(
            [np.abs(r - c.logprobs) for r, c in zip(recomputed, completions, strict=True)]
        )
        print(f"cuda {dtype} gen -> cpu fp32 oracle: max {diff.max():.2e} mean {diff.mean():.2e}")
        tolerance = FLOAT32_TOLERANCE if dtype == "float32" else BFLOAT16_TOLERANCE
        for r, c in zip(recomputed, completions, strict=True):
            compare_chunk(c.logprobs, r, tolerance, 0)
