"""The vLLM backend emits the verifiable sample and commits the same logprobs.

CPU tests drive the logits processor through both vLLM processor interfaces
with a stand-in engine (stub base classes, a tiny transformers model) and
compare with ``TransformersBackend``. ``gpu`` tests run the real engine; they
also skip where ``vllm`` is not installed.
"""

from __future__ import annotations

import enum
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout import vllm_backend
from rollout.backends import GenerationRequest, TransformersBackend, available_backends
from rollout.oracle import TransformersOracle
from rollout.vllm_backend import RowSpec, VllmSamplerError, collect_logprobs
from verify.errors import ConfigError
from verify.samplers import sampler_named
from verify.spotcheck import BFLOAT16_TOLERANCE, FLOAT32_TOLERANCE, OracleRequest, compare_chunk

torch.set_num_threads(1)
VOCAB = 256
KEY = bytes(range(32))
NONCE = b"\x42" * 32
PROMPT = (0, 17, 23, 99, 5, 64, 3)
STOPS = tuple(range(1, VOCAB, 16))  # 16 stop tokens: completions end at different steps
# Replay slack per generation dtype (verify/sampling.py): fp32 1e-4, bf16 near-ties up to ~0.2.
SETTINGS = {"float32": (FLOAT32_TOLERANCE, 1e-4), "bfloat16": (BFLOAT16_TOLERANCE, 0.2)}


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )  # head_dim 64: every vLLM attention backend supports it
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # peaked, LM-like next-token distributions
    return model.eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    _tiny_llama().save_pretrained(path)
    return path


def _request(
    temperature=1.0, top_k=0, top_p=1.0, group=4, max_tokens=24, seed=11, nonce=NONCE, stops=STOPS
):
    return GenerationRequest(
        PROMPT, group, temperature, top_k, top_p, max_tokens, KEY, nonce, seed, stop_token_ids=stops
    )


# --- stand-in engine: the processor under both vLLM interfaces, on CPU ----------------------


class _Move(enum.Enum):
    UNIDIRECTIONAL = 1
    SWAP = 2


@dataclass
class _Update:
    batch_size: int
    removed: list = field(default_factory=list)
    added: list = field(default_factory=list)
    moved: list = field(default_factory=list)


class _V1Base(ABC):
    @classmethod
    def validate_params(cls, sampling_params):
        return None

    @abstractmethod
    def __init__(self, vllm_config, device, is_pin_memory): ...

    @abstractmethod
    def apply(self, logits): ...

    @abstractmethod
    def is_argmax_invariant(self): ...

    @abstractmethod
    def update_state(self, batch_update): ...


class _V2Base(ABC):
    def __init__(self, vllm_config, req_states):  # noqa: B027
        pass

    def add_request(self, req_idx, sampling_params):
        return True

    @abstractmethod
    def apply(self, logits, ctx): ...


def _stub_vllm(monkeypatch, interfaces: tuple[str, ...]) -> type:
    """Install stub ``vllm`` interface modules and return the processor class built on them."""
    names = [
        "vllm",
        "vllm.v1",
        "vllm.v1.sample",
        "vllm.v1.sample.logits_processor",
        "vllm.v1.worker",
        "vllm.v1.worker.gpu",
        "vllm.v1.worker.gpu.sample",
        "vllm.v1.worker.gpu.sample.logits_processor",
        "vllm.v1.worker.gpu.sample.logits_processor.interface",
    ]
    modules = {name: types.ModuleType(name) for name in names}
    if "v1" in interfaces:
        modules["vllm.v1.sample.logits_processor"].LogitsProcessor = _V1Base
    else:
        del modules["vllm.v1.sample.logits_processor"]
    if "v2" in interfaces:
        modules["vllm.v1.worker.gpu.sample.logits_processor.interface"].LogitsProcessor = _V2Base
    else:
        del modules["vllm.v1.worker.gpu.sample.logits_processor.interface"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    vllm_backend.processor_class.cache_clear()
    cls = vllm_backend.processor_class()
    vllm_backend.processor_class.cache_clear()
    return cls


def _last_logits(model, rows: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([r])).logits[0, -1].float() for r in rows])


def _specs(request):
    return [
        RowSpec(
            f"tag-{g}",
            KEY,
            request.nonce,
            request.seed,
            g,
            request.temperature,
            request.top_k,
            request.top_p,
            len(PROMPT),
        )
        for g in range(request.group_size)
    ]


def _run_v1(proc, model, request) -> list[list[int]]:
    """A persistent batch like vLLM's: finished rows are removed and the last row moved in."""
    specs = _specs(request)
    outs: list[list[int]] = [[] for _ in specs]
    batch = list(range(len(specs)))  # row -> completion
    params = [SimpleNamespace(extra_args=s.to_extra_args()) for s in specs]
    # A partial prefill chunk samples a token that is then thrown away.
    proc.update_state(_Update(1, added=[(0, params[0], list(PROMPT), outs[0])]))
    proc.apply(_last_logits(model, [list(PROMPT[:3])]))
    proc.update_state(
        _Update(
            len(batch), added=[(r, params[g], list(PROMPT), outs[g]) for r, g in enumerate(batch)]
        )
    )
    step = 0
    while batch:
        logits = proc.apply(_last_logits(model, [list(PROMPT) + outs[g] for g in batch]))
        assert bool((torch.isfinite(logits).sum(-1) == 1).all())
        for r, g in enumerate(batch):
            outs[g].append(int(logits[r].argmax()))
        done = [
            r
            for r, g in enumerate(batch)
            if outs[g][-1] in STOPS or len(outs[g]) == request.max_tokens
        ]
        update = _Update(0, removed=sorted(done, reverse=True))
        for r in sorted(done, reverse=True):
            last = len(batch) - 1
            if r != last:
                update.moved.append((last, r, _Move.UNIDIRECTIONAL))
                batch[r] = batch[last]
            batch.pop()
        step += 1
        if step == 2 and len(batch) >= 2:
            update.moved.append((0, 1, _Move.SWAP))
            batch[0], batch[1] = batch[1], batch[0]
        update.batch_size = len(batch)
        proc.update_state(update)
    return outs


def _run_v2(proc, model, request) -> list[list[int]]:
    """Rows keyed by request slots, reordered every step; one slot declined (no sampler)."""
    specs = _specs(request)
    outs: list[list[int]] = [[] for _ in specs]
    slots = {g: 7 + 2 * g for g in range(len(specs))}
    assert proc.add_request(3, SimpleNamespace(extra_args=None)) is False
    for g, s in enumerate(specs):
        assert proc.add_request(slots[g], SimpleNamespace(extra_args=s.to_extra_args())) is True
    # A partial prefill chunk (position 2 of a 7-token prompt) is left untouched.
    chunk = _last_logits(model, [list(PROMPT[:3])])
    ctx = SimpleNamespace(idx_mapping_np=np.array([slots[0]]), pos=torch.tensor([2]))
    assert torch.equal(proc.apply(chunk.clone(), ctx), chunk)
    active = list(range(len(specs)))
    step = 0
    while active:
        order = active[::-1] if step % 2 else active  # rows are reordered between steps
        seqs = [list(PROMPT) + outs[g] for g in order] + [list(PROMPT)]
        ctx = SimpleNamespace(
            idx_mapping_np=np.array([slots[g] for g in order] + [3]),
            pos=torch.tensor([len(s) - 1 for s in seqs]),
        )
        raw = _last_logits(model, seqs)
        logits = proc.apply(raw.clone(), ctx)
        assert torch.equal(logits[-1], raw[-1])  # the declined request's row
        for r, g in enumerate(order):
            outs[g].append(int(logits[r].argmax()))
        active = [
            g for g in active if outs[g][-1] not in STOPS and len(outs[g]) < request.max_tokens
        ]
        step += 1
    return outs


@pytest.mark.parametrize("interfaces", [("v1",), ("v2",), ("v1", "v2")])
@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.0, 0, 1.0)])
def test_stand_in_engine_matches_transformers_backend(monkeypatch, interfaces, params):
    cls = _stub_vllm(monkeypatch, interfaces)
    model = _tiny_llama()
    request = _request(*params)
    expected = TransformersBackend(model, dtype="float32").generate(request)
    engines = {
        "v1": lambda: _run_v1(cls(None, torch.device("cpu"), False), model, request),
        "v2": lambda: _run_v2(cls(None, None), model, request),
    }
    for name in interfaces:
        outs = engines[name]()
        lengths = set()
        for g, want in enumerate(expected):
            assert tuple(outs[g]) == want.token_ids
            got = collect_logprobs(f"tag-{g}", outs[g])
            assert np.abs(got - want.logprobs).max() <= 1e-5
            lengths.add(len(outs[g]))
        assert len(lengths) > 1 or params[0] == 0.0  # rows left the batch at different steps
    assert not vllm_backend._RECORDS


def test_collect_logprobs_rejects_missing_or_foreign_tokens():
    with pytest.raises(VllmSamplerError, match="outside this process"):
        collect_logprobs("never-recorded", [5])
    vllm_backend._RECORDS["t"] = {0: (5, -0.5), 1: (9, -1.25)}
    with pytest.raises(VllmSamplerError, match="position 1"):
        collect_logprobs("t", [5, 8])
    vllm_backend._RECORDS["t"] = {0: (5, -0.5)}
    with pytest.raises(VllmSamplerError, match="position 1"):
        collect_logprobs("t", [5, 9])
    vllm_backend._RECORDS["t"] = {0: (5, -0.5), 1: (9, -1.25)}
    got = collect_logprobs("t", [5, 9])
    assert got.dtype == np.float32 and got.tolist() == [-0.5, -1.25] and not got.flags.writeable
    assert "t" not in vllm_backend._RECORDS


def test_row_spec_round_trip_and_malformed_entries():
    spec = _specs(_request(0.7, 20, 0.9))[2]
    assert RowSpec.from_extra_args(spec.to_extra_args()) == spec
    assert RowSpec.from_extra_args(None) is None
    assert RowSpec.from_extra_args({"other": 1}) is None
    broken = spec.to_extra_args()
    del broken[vllm_backend.EXTRA_ARGS_KEY]["nonce"]
    with pytest.raises(ValueError, match="malformed"):
        RowSpec.from_extra_args(broken)


def test_config_errors_without_a_gpu(monkeypatch, tmp_path):
    for name in (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "VLLM_NO_USAGE_STATS",
        "DO_NOT_TRACK",
    ):
        monkeypatch.setenv(name, "1")  # restored afterwards: the backend sets them
    assert "vllm" in available_backends()
    with pytest.raises(ConfigError, match="local model directory"):
        vllm_backend.VllmBackend("meta-llama/Llama-3-8B")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        vllm_backend.VllmBackend(tmp_path, gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError):
        vllm_backend.VllmBackend(tmp_path, dtype="float8")
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"prooftrain\[vllm\]"):
        vllm_backend.VllmBackend(tmp_path)


# --- real vLLM on a GPU ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def vllm_run(request, model_dir):
    pytest.importorskip("vllm")
    backend = vllm_backend.VllmBackend(
        model_dir, dtype=request.param, enforce_eager=True, gpu_memory_utilization=0.2
    )
    yield request.param, backend
    backend.close()


def _oracle_logits(oracle, completion):
    return oracle.completion_logits(0, PROMPT + completion.token_ids, len(PROMPT))


@pytest.mark.gpu
@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.0, 0, 1.0)])
def test_vllm_tokens_replay_and_logprobs_match_recomputation(vllm_run, model_dir, params):
    dtype, backend = vllm_run
    tolerance, eps = SETTINGS[dtype]
    request = _request(*params, group=8, max_tokens=64)
    completions = backend.generate(request)
    oracle = TransformersOracle({0: model_dir}, dtype="float32")
    recomputed = oracle.logprobs_batch(
        0, [OracleRequest(PROMPT + c.token_ids, len(PROMPT), *params) for c in completions]
    )
    exact = total = 0
    worst = max_gap = 0.0
    for c, r in zip(completions, recomputed, strict=True):
        sampler = sampler_named(request.sampler)
        uniforms = sampler.randomness(
            [(KEY, NONCE, request.seed, c.group_index, range(len(c.token_ids)))], VOCAB
        )
        stats = sampler.replay(
            c.token_ids,
            _oracle_logits(oracle, c),
            *params,
            uniforms,
            slack=sampler.slack(tolerance) if eps > 1e-4 else 1e-4,
        )
        exact, total, max_gap = (
            exact + stats.exact,
            total + stats.tokens,
            max(max_gap, stats.max_gap),
        )
        for start in range(0, len(c.token_ids), 32):
            compare_chunk(
                c.logprobs[start : start + 32],
                r[start : start + 32],
                tolerance,
                start // 32,
                position_offset=start,
            )
        worst = max(worst, float(np.abs(c.logprobs - r).max()))
    print(
        f"vllm {backend.vllm_version} {dtype} {params}: {total} tokens, exact replay "
        f"{exact}/{total}, max near-tie gap {max_gap:.2e}, max |logprob - cpu fp32| {worst:.2e}"
    )


@pytest.mark.gpu
def test_vllm_agrees_with_transformers_backend(vllm_run, model_dir, monkeypatch):
    dtype, backend = vllm_run
    tolerance, _ = SETTINGS[dtype]
    request = _request(0.7, 20, 0.9, group=8, max_tokens=64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # a float32 reference
    theirs = TransformersBackend(model_dir, device=device, dtype=dtype).generate(request)
    ours = backend.generate(request)
    same, worst = 0, 0.0
    for a, b in zip(ours, theirs, strict=True):
        same += a.token_ids == b.token_ids
        prefix = next(
            (t for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
            min(len(a.token_ids), len(b.token_ids)),
        )
        if prefix:
            worst = max(worst, float(np.abs(a.logprobs[:prefix] - b.logprobs[:prefix]).max()))
    print(
        f"vllm vs transformers ({dtype}, {device}): {same}/8 identical completions, "
        f"max |logprob diff| on shared prefixes {worst:.2e}"
    )
    assert worst <= tolerance.token_abs
    if dtype == "float32":
        assert same >= 7  # only a numerical near-tie may split a completion


@pytest.mark.gpu
def test_vllm_completions_are_well_formed_and_keyed_by_nonce(vllm_run):
    _, backend = vllm_run
    request = _request(group=8, max_tokens=64)
    first = backend.generate(request)
    assert [c.group_index for c in first] == list(range(8))
    for c in first:
        assert c.logprobs.dtype == np.float32 and c.logprobs.shape == (len(c.token_ids),)
        assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in STOPS)
        assert not set(c.token_ids[:-1]) & set(STOPS) and len(c.token_ids) <= 64
    assert len({len(c.token_ids) for c in first}) > 1
    assert [c.token_ids for c in backend.generate(request)] == [c.token_ids for c in first]
    other = backend.generate(_request(group=8, max_tokens=64, nonce=b"\x43" * 32))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]
    short = backend.generate(_request(group=3, max_tokens=1, stops=()))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in short)
    both = backend.generate_many([request, _request(seed=12, group=2)])
    assert [c.token_ids for c in both[0]] == [c.token_ids for c in first]
    assert [c.group_index for c in both[1]] == [0, 1]
