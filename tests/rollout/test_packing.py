"""The packed forward layout: what it computes, when the oracle uses it, and when it must not."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rollout.backends import load_causal_lm
from rollout.oracle import TransformersOracle
from rollout.packing import attention_span, packed_width_limit

torch.set_num_threads(1)


def _padded(model) -> TransformersOracle:  # type: ignore[no-untyped-def]
    """The reference: one padded row per sequence, never packed, never a shared prefix."""
    return TransformersOracle({0: model}, max_packed_tokens=0, min_prefix_savings=10**9)


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert [x.shape for x in got] == [x.shape for x in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


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
    padded = _padded(tiny_model)
    shared = TransformersOracle(
        {0: tiny_model}, min_prefix_savings=0, max_batch_tokens=40, max_packed_tokens=0
    )
    packed = TransformersOracle({0: tiny_model}, max_batch_tokens=40)  # several packed batches
    mixed = TransformersOracle({0: tiny_model}, min_prefix_savings=0, max_packed_tokens=24)
    assert packed.packs(0) and mixed.packs(0) and not padded.packs(0)
    want = padded.logits_batch(0, seqs)
    assert [tuple(x.shape) for x in want] == [
        (len(ids) - p, x.shape[-1]) for (ids, p), x in zip(seqs, want, strict=True)
    ]
    for oracle in (shared, packed, mixed):
        _assert_same(oracle.logits_batch(0, seqs), want)


def test_a_packed_group_runs_its_prompt_once_and_pads_nothing(tiny_model) -> None:
    prompt = [5, 9, 11, 4]
    seqs = [(prompt + [7 + k] * n, len(prompt)) for k, n in enumerate([3, 1, 4, 0, 2])]
    oracle = TransformersOracle({0: tiny_model})
    assert oracle.packs(0)  # the probe's own forward calls come first
    widths: list[tuple[int, ...]] = []
    hook = oracle.model(0).register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
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
    _assert_same(oracle.logits_batch(0, seqs), _padded(tiny_model).logits_batch(0, seqs))
    # and the packed layout itself is what the probe rejected: it would have answered wrongly
    wrong: list[torch.Tensor | None] = [None] * 3
    probe = [([5, 9, 11, 7, 7, 7], 3), ([5, 9, 11, 8, 8], 3), ([5, 9, 11, 6, 6, 6], 3)]
    oracle._run_packed(oracle.model(0), probe, [[0, 1, 2]], wrong)
    right = _padded(tiny_model).logits_batch(0, probe)
    assert (
        max(float((g - w).abs().max()) for g, w in zip(wrong, right, strict=True) if g is not None)
        > 1e-3
    )


def test_a_sliding_window_bounds_the_packed_rows(tiny_model) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(
        MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=6,
            attn_implementation="sdpa",
        )
    ).eval()
    oracle = TransformersOracle({0: model})
    assert oracle.packs(0) and oracle._packs[0] == 6
    rng = random.Random(7)
    prompt = [rng.randrange(3, 60) for _ in range(3)]
    seqs = [
        (prompt + [rng.randrange(3, 60) for _ in range(n)], 3) for n in (2, 3, 9)
    ]  # packed: 14 slots
    want = _padded(model).logits_batch(0, seqs)
    _assert_same(oracle.logits_batch(0, seqs), want)
    # packed anyway, the row's mask would let the last completion see past the window
    wide: list[torch.Tensor | None] = [None] * len(seqs)
    oracle._run_packed(oracle.model(0), seqs, [[0, 1, 2]], wide)
    assert float((wide[2] - want[2]).abs().max()) > 1e-3  # type: ignore[operator]


def test_packing_is_probed_once_per_architecture(tiny_model, other_model) -> None:
    oracle = TransformersOracle({0: tiny_model, 1: other_model}, max_versions=1)
    calls: list[int] = []
    probe = oracle._packing_matches
    oracle._packing_matches = lambda m, limit: calls.append(1) or probe(m, limit)  # type: ignore[method-assign]
    assert oracle.packs(0) and oracle.packs(0) and calls == [1]
    oracle.model(1)  # evicts version 0; the next version has other weights, the same shape
    assert oracle.packs(1) and oracle.packs(0) and calls == [1]
    with pytest.raises(ValueError, match="max_packed_tokens"):
        TransformersOracle({0: tiny_model}, max_packed_tokens=-1)


def test_attention_spans_are_read_from_every_field_that_names_one() -> None:
    assert attention_span(SimpleNamespace()) is None
    assert attention_span(SimpleNamespace(sliding_window=None, window_size=0)) is None
    assert attention_span(SimpleNamespace(sliding_window=4096)) == 4096
    assert attention_span(SimpleNamespace(window_size=256, attention_chunk_size=8192)) == 256
    assert attention_span(SimpleNamespace(text_config=SimpleNamespace(sliding_window=512))) == 512
    assert (
        attention_span(SimpleNamespace(use_cache=True, sliding_window=True)) is None
    )  # a flag, not a span


def test_a_local_attention_window_bounds_the_packed_rows() -> None:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    model = GPTNeoForCausalLM(
        GPTNeoConfig(
            vocab_size=64,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            window_size=8,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=128,
        )
    ).eval()
    oracle = TransformersOracle({0: model})
    assert packed_width_limit(model) > 8 and oracle.packs(0) and oracle._packs[0] == 8
    rng = random.Random(8)
    prompt = [rng.randrange(3, 60) for _ in range(3)]
    seqs = [(prompt + [rng.randrange(3, 60) for _ in range(n)], 3) for n in (12, 3, 2, 4)]
    _assert_same(oracle.logits_batch(0, seqs), _padded(model).logits_batch(0, seqs))


class HiddenWindow(torch.nn.Module):
    """A causal LM whose attention only reaches ``window`` slots back, with no config field
    saying so: the packed layout cannot honour it, and the probe must find that out."""

    def __init__(self, inner: torch.nn.Module, window: int) -> None:
        super().__init__()
        self.inner, self.window, self.config = inner, window, inner.config

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        width = input_ids.shape[1]
        slots = torch.arange(width)
        near = (slots[:, None] >= slots[None, :]) & (slots[:, None] - slots[None, :] < self.window)
        if attention_mask is None:
            sees = near[None].expand(input_ids.shape[0], width, width)
        elif attention_mask.dim() == 2:
            sees = near[None] & attention_mask.bool()[:, None, :]
        else:
            sees = near[None] & (attention_mask[:, 0] == 0)
        sees = sees | torch.eye(width, dtype=torch.bool)[None]
        dtype = next(self.inner.parameters()).dtype
        mask = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, torch.finfo(dtype).min)
        return self.inner(input_ids=input_ids, attention_mask=mask[:, None], **kwargs)


def test_a_model_with_an_unnamed_local_window_is_not_packed(tiny_model) -> None:
    model = HiddenWindow(load_causal_lm(tiny_model, "cpu", None), window=16)
    oracle = TransformersOracle({0: model}, min_prefix_savings=10**9)
    assert packed_width_limit(model) > 16 and attention_span(model.config) is None
    assert not oracle.packs(0)  # its probe row is as wide as the limit: the window shows
    seqs = _random_seqs(random.Random(9))
    _assert_same(oracle.logits_batch(0, seqs), _padded(model).logits_batch(0, seqs))


class DropsPackedPositions(IgnoresCustomMasks):
    """A causal LM that keeps a 4-D mask but recomputes positions from the slots."""

    def forward(self, attention_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        if attention_mask is not None and attention_mask.dim() == 4:
            kwargs.pop("position_ids", None)
        return self.inner(attention_mask=attention_mask, **kwargs)


def test_a_model_that_ignores_packed_positions_is_not_packed(tiny_model) -> None:
    # float32: in bfloat16 a random model's positions move its logits by about as much as
    # rounding does (2 ulps of the largest logit here), so only a trained model would show it
    model = DropsPackedPositions(load_causal_lm(tiny_model, "cpu", None))
    assert not TransformersOracle({0: model}).packs(0)
    assert TransformersOracle({0: tiny_model}).packs(0)  # the model itself packs


def test_a_bfloat16_model_packs_and_matches_its_padded_rows_within_rounding(tiny_model) -> None:
    oracle = TransformersOracle({0: tiny_model}, dtype="bfloat16")
    assert oracle.packs(0)
    seqs = _random_seqs(random.Random(10))
    want = TransformersOracle(
        {0: tiny_model}, dtype="bfloat16", max_packed_tokens=0, min_prefix_savings=10**9
    ).logits_batch(0, seqs)
    for g, w in zip(oracle.logits_batch(0, seqs), want, strict=True):
        scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
        assert g.shape == w.shape and (not g.numel() or float((g - w).abs().max()) <= 2**-6 * scale)


ARCHITECTURES = {  # name: (model class, config class, config, packs)
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        True,
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(n_embd=32, n_layer=2, n_head=4),
        True,
    ),  # Conv1D weights
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
        True,
    ),
    "opt": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
        ),
        True,
    ),
    "bloom": (
        "BloomForCausalLM",
        "BloomConfig",
        dict(hidden_size=32, n_layer=2, n_head=4),
        False,
    ),  # ALiBi
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_architecture_packs_only_where_packing_gives_its_padded_logits(name) -> None:
    import transformers

    cls, config_cls, config, packs = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(
        getattr(transformers, config_cls)(vocab_size=64, **config)
    ).eval()
    oracle = TransformersOracle({0: model}, min_prefix_savings=10**9)
    assert oracle.packs(0) is packs
    seqs = _random_seqs(random.Random(11))
    _assert_same(oracle.logits_batch(0, seqs), _padded(model).logits_batch(0, seqs))
