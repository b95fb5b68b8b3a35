"""Weight-delta codec: round trips, error feedback, determinism, hostile bytes, size."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from verify.errors import ConfigError, DecodeError, Reason
from verify.weights_codec import (
    CODECS,
    Codec,
    CodecId,
    DecodeLimits,
    DeltaHeader,
    ErrorFeedback,
    Fp32,
    Int8Block,
    ScaleDtype,
    TopK,
    add_state_delta_,
    apply_delta,
    apply_state_delta,
    decode_delta,
    decode_state_delta,
    encode_state_delta,
    encode_state_delta_applied_,
    get_codec,
    parse_header,
    split_state_delta,
)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=60, deadline=None)

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)
floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)
CODEC_LIST: list[Codec] = [
    Fp32(),
    Int8Block(),
    Int8Block(block_size=5, scale_dtype="float32"),
    Int8Block(block_size=3, scale_dtype="float16"),
    TopK(fraction=0.3),
    TopK(k=3, int8=False),
    TopK(fraction=1.0, block_size=7),
]


def _tensor(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


# -- round trips ------------------------------------------------------------------------


@SETTINGS
@given(hnp.arrays(np.float32, shapes, elements=floats))
def test_fp32_round_trip_is_exact(arr: np.ndarray) -> None:
    x = _tensor(arr)
    assert torch.equal(decode_delta(Fp32().encode(x)), x)


SCALE_REL = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}
SCALE_TINY = {"bfloat16": 1e-38, "float16": 2.0**-24, "float32": 1e-38}


@SETTINGS
@given(
    hnp.arrays(np.float32, shapes, elements=floats | st.floats(-(2.0**-20), 2.0**-20, width=32)),
    st.integers(1, 70),
    st.sampled_from(sorted(SCALE_REL)),
)
def test_int8_error_is_within_half_a_step(arr: np.ndarray, block: int, scale: str) -> None:
    x = _tensor(arr)
    codec = Int8Block(block_size=block, scale_dtype=scale)  # type: ignore[arg-type]
    data = codec.encode(x)
    y = decode_delta(data)
    assert y.shape == x.shape and y.dtype == torch.float32
    flat_x, flat_y = x.flatten(), y.flatten()
    for start in range(0, flat_x.numel(), block):
        bx, by = flat_x[start : start + block], flat_y[start : start + block]
        # stored scale: absmax/127 rounded up to the scale type; error <= half of it
        step = float(bx.abs().max()) / 127 * (1 + SCALE_REL[scale]) + SCALE_TINY[scale]
        assert float((bx - by).abs().max()) <= step / 2 * (1 + 1e-6)
    assert data == codec.encode(x)  # encoding is a function of the input


def test_bfloat16_scales_keep_tiny_deltas() -> None:
    """Learning-rate-sized deltas (1e-7) survive bfloat16 scales; float16 scales lose them."""
    x = torch.full((64,), 1e-7) * torch.linspace(-1, 1, 64)
    for scale, tol in (("bfloat16", 0.01), ("float32", 0.01)):
        y = decode_delta(Int8Block(scale_dtype=scale).encode(x))  # type: ignore[arg-type]
        assert float((y - x).norm() / x.norm()) < tol
    y = decode_delta(Int8Block(scale_dtype="float16").encode(x))
    assert float((y - x).norm() / x.norm()) > 0.05


@SETTINGS
@given(hnp.arrays(np.float32, shapes, elements=floats), st.floats(0.01, 1.0), st.booleans())
def test_topk_keeps_the_largest(arr: np.ndarray, fraction: float, int8: bool) -> None:
    x = _tensor(arr)
    y = decode_delta(TopK(fraction=fraction, int8=int8).encode(x))
    n = x.numel()
    k = min(n, max(1, int(np.ceil(fraction * n)))) if n else 0
    kept = y.flatten() != 0
    assert int(kept.sum()) <= k
    if not int8:
        # every kept value is exact and at least as large as every dropped one
        assert torch.equal(y.flatten()[kept], x.flatten()[kept])
        dropped = x.flatten()[~kept].abs()
        if kept.any() and dropped.numel():
            assert float(dropped.max()) <= float(x.flatten()[kept].abs().min())


@SETTINGS
@given(hnp.arrays(np.float32, shapes, elements=floats), st.sampled_from(CODEC_LIST))
def test_apply_delta_is_weights_plus_decoded(arr: np.ndarray, codec: Codec) -> None:
    x = _tensor(arr)
    w = torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape) * 0.37
    data = codec.encode(x)
    assert torch.equal(apply_delta(w, data), w + decode_delta(data))
    assert parse_header(data).shape == tuple(x.shape)


# -- error feedback ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "codec", [Int8Block(), TopK(fraction=0.05), TopK(fraction=0.05, int8=False)]
)
def test_error_feedback_tracks_the_true_sum(codec: Codec) -> None:
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback()
    true_sum = torch.zeros(4096)
    sent_sum = torch.zeros(4096)
    no_ef_sum = torch.zeros(4096)
    worst = 0.0
    steps = 200
    for _ in range(steps):
        delta = torch.randn(4096, generator=gen) * 1e-3 + 2e-4  # a small persistent drift
        true_sum += delta
        sent_sum = apply_delta(sent_sum, ef.encode("w", delta, codec))
        no_ef_sum = apply_delta(no_ef_sum, codec.encode(delta))
        residual = ef.residual("w")
        assert residual is not None
        # invariant: what was sent plus what is owed is what happened
        torch.testing.assert_close(sent_sum + residual, true_sum, rtol=0, atol=1e-5)
        worst = max(worst, float(residual.abs().max()))
    # the residual stays bounded (no growth with the step count) ...
    assert worst < 100 * 1e-3
    gap = float((sent_sum - true_sum).norm() / true_sum.norm())
    # ... and error feedback beats compressing each step alone
    gap_no_ef = float((no_ef_sum - true_sum).norm() / true_sum.norm())
    assert gap < 0.2 and gap < gap_no_ef


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and +0.0 differ here


block_shapes = st.sampled_from([(0,), (6,), (2, 6), (3, 4), (5, 1, 6), (12,)])
signed_zeros = st.sampled_from([0.0, -0.0])
subnormals = st.sampled_from([1e-40, -1e-40, 1.4e-45, -3e-39])
values = st.one_of(floats, signed_zeros, subnormals)


@SETTINGS
@given(
    st.data(),
    st.sampled_from(CODEC_LIST + [Int8Block(block_size=6), Int8Block(block_size=2)]),
)
def test_encoding_in_place_advances_weights_as_a_contributor_does(
    data: st.DataObject, codec: Codec
) -> None:
    """The publisher's one-pass encode-and-apply: the same blob as ``encode_state_delta``,
    and weights bit for bit what ``add_state_delta_`` makes of it, signed zeros, zero
    blocks and subnormals included, whether the codec encodes in place or not."""
    names = data.draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True))
    weights, deltas = {}, {}
    for n in names:
        shape = data.draw(block_shapes)
        weights[n] = _tensor(data.draw(hnp.arrays(np.float32, shape, elements=values)))
        zero_block = data.draw(st.booleans())
        d = _tensor(data.draw(hnp.arrays(np.float32, shape, elements=values)))
        deltas[n] = d * 0.0 if zero_block else d  # x * 0.0 keeps the signs of the zeros
    want_blob = encode_state_delta({n: d.clone() for n, d in deltas.items()}, codec)
    want = {n: w.clone() for n, w in weights.items()}
    add_state_delta_(want, want_blob)
    got = {n: w.clone() for n, w in weights.items()}
    blob = encode_state_delta_applied_(got, {n: d.clone() for n, d in deltas.items()}, codec)
    assert blob == want_blob
    for n in names:
        assert torch.equal(_bits(got[n]), _bits(want[n])), n


@pytest.mark.parametrize("scale", ["float32", "bfloat16", "float16"])
def test_in_place_int8_clamps_exactly_where_a_value_would_round_past_127(scale: str) -> None:
    """The in-place encoder clamps q to [-127, 127] only when some block's absmax divided by
    its stored scale reaches 127.5. Across every float32 exponent that never happens where
    the scale is a normal float32 its storage type can hold; a float32 subnormal absmax
    (190 x 2^-149, whose float32 scale rounds down to 2^-149) and a float16 scale saturated
    at 65504 both make it happen. Either way the bytes are the reference encoder's."""
    from verify.delta_quant import _rounds_past_127, _safe, _stored_scale

    sd = ScaleDtype[scale.upper()]
    gen = torch.Generator().manual_seed(0)
    top = 15 if scale == "float16" else 126  # float16 scales saturate above 65504 * 127
    exponents = torch.randint(-125, top, (4096, 1), generator=gen).float()
    x = (torch.rand((4096, 64), generator=gen) * 2 - 1) * torch.exp2(exponents)
    absmax = x.abs().amax(dim=1)
    divisor = _safe(_stored_scale(absmax, sd))
    assert not _rounds_past_127(absmax, divisor)
    assert float((x / divisor[:, None]).round().abs().max()) == 127.0

    sub = torch.zeros(64)
    sub[3] = 190 * 2.0**-149
    huge = torch.full((64,), 3.0e38)
    cases = [x[:8].flatten(), sub, huge]
    for values in cases:
        peak = values.view(-1, 64).abs().amax(dim=1)
        past = _rounds_past_127(peak, _safe(_stored_scale(peak, sd)))
        assert past == (
            (values is sub and scale == "float32") or (values is huge and scale == "float16")
        )
        codec = Int8Block(scale_dtype=scale)  # type: ignore[arg-type]
        pieces = codec.encode_decoded_(values.clone())
        if pieces is not None:  # None: a decoded value could overflow (the reference path)
            assert b"".join(bytes(p) for p in pieces) == codec.encode(values.clone())


def test_encoding_in_place_refuses_a_bad_delta_before_changing_a_weight() -> None:
    weights = {"a": torch.zeros(64), "b": torch.ones(64)}
    deltas = {"a": torch.full((64,), 0.5), "b": torch.full((64,), float("nan"))}
    with pytest.raises(ValueError, match="non-finite"):
        encode_state_delta_applied_(weights, deltas, Int8Block())
    assert torch.equal(weights["a"], torch.zeros(64))
    assert torch.equal(deltas["b"].isnan(), torch.ones(64, dtype=torch.bool))
    with pytest.raises(ValueError, match="different parameters"):
        encode_state_delta_applied_(weights, {"a": torch.zeros(64)}, Int8Block())
    assert torch.equal(weights["a"], torch.zeros(64)) and torch.equal(weights["b"], torch.ones(64))


@pytest.mark.parametrize("scale", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("value", [3.4028234e38, -3.4028234e38, 3.4e38, 3.0e38])
def test_encoding_in_place_at_the_float32_limit_matches_a_contributor(
    scale: str, value: float
) -> None:
    """Where a decoded value could overflow, both paths agree: the same weights, or the
    same refusal (a decoder cannot apply a value that overflows)."""
    codec = Int8Block(scale_dtype=scale)
    blob = encode_state_delta({"b": torch.full((64,), value)}, codec)
    want = {"b": torch.zeros(64)}
    try:
        add_state_delta_(want, blob)
    except DecodeError:
        with pytest.raises(DecodeError):
            encode_state_delta_applied_(
                {"b": torch.zeros(64)}, {"b": torch.full((64,), value)}, codec
            )
        return
    got = {"b": torch.zeros(64)}
    assert encode_state_delta_applied_(got, {"b": torch.full((64,), value)}, codec) == blob
    assert torch.equal(_bits(got["b"]), _bits(want["b"]))


def test_error_feedback_checks_shapes() -> None:
    ef = ErrorFeedback()
    ef.encode("w", torch.ones(4), Int8Block())
    with pytest.raises(ValueError):
        ef.encode("w", torch.ones(5), Int8Block())
    ef.reset()
    assert ef.residual("w") is None


# -- determinism ------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import hashlib, json, struct, sys, torch
    torch.set_num_threads(3)
    from verify.weights_codec import apply_state_delta
    data, out = sys.stdin.buffer.read(), []
    while data:
        (size,) = struct.unpack_from("<Q", data)
        blob, data = data[8 : 8 + size], data[8 + size :]
        w = {"a.weight": torch.linspace(-1, 1, 3000).reshape(30, 100), "b": torch.full((7,), 0.1)}
        new = apply_state_delta(w, blob)
        out.append({k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in new.items()})
    print(json.dumps(out))
    """
)


def _digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in weights.items()}


def test_decoding_is_bit_exact_across_processes() -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = {
        "a.weight": torch.randn(30, 100, generator=gen) * 1e-2,
        "b": torch.randn(7, generator=gen),
    }
    weights = {"a.weight": torch.linspace(-1, 1, 3000).reshape(30, 100), "b": torch.full((7,), 0.1)}
    blobs = [encode_state_delta(deltas, c) for c in (Int8Block(), TopK(fraction=0.1), Fp32())]
    here = []
    for blob in blobs:
        first = _digests(apply_state_delta(weights, blob))
        assert first == _digests(apply_state_delta(weights, blob))
        here.append(first)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=b"".join(struct.pack("<Q", len(b)) + b for b in blobs),
        capture_output=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert json.loads(child.stdout) == here


def test_golden_vector() -> None:
    """Fixed input, fixed bytes: a format change must be deliberate."""
    x = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0], dtype=torch.float32)
    data = Int8Block(block_size=4, scale_dtype="float32").encode(x)
    head = struct.pack("<4sBBBBIQQ", b"PTWD", 1, 1, 0, 1, 4, 0, 5)
    scales = np.array([1.0 / 127, 2.0 / 127], dtype="<f4").tobytes()
    q = bytes([64, 256 - 127, 32, 0, 127])  # round(0.5*127)=64 (half to even: 63.5 -> 64)
    assert data == head + scales + q
    np.testing.assert_array_equal(
        decode_delta(data).numpy(),
        np.array([64, -127, 32, 0, 127], dtype=np.float32)
        * np.repeat(np.frombuffer(scales, "<f4"), 4)[:5],
    )


# -- hostile bytes ----------------------------------------------------------------------


def _good() -> bytes:
    return TopK(fraction=0.5).encode(torch.linspace(-1, 1, 10))


def _expect(data: bytes, reason: Reason, limits: DecodeLimits | None = None) -> None:
    with pytest.raises(DecodeError) as info:
        decode_delta(data, limits or DecodeLimits())
    assert info.value.reason is reason, str(info.value)


def test_truncated_and_trailing_bytes_rejected() -> None:
    good = _good()
    for cut in range(len(good)):
        _expect(good[:cut], Reason.TRUNCATED)
    _expect(good + b"\0", Reason.TRAILING_BYTES)
    _expect(b"\0" + good, Reason.MALFORMED)  # leading garbage


def test_bad_header_fields_rejected() -> None:
    def hdr(**kw: object) -> bytes:
        fields: dict[str, object] = dict(
            magic=b"PTWD", version=1, codec=0, scale=0, ndim=1, block=0, nnz=0, dims=[3]
        )
        fields.update(kw)
        dims = fields.pop("dims")
        assert isinstance(dims, list)
        return struct.pack("<4sBBBBIQ", *fields.values()) + b"".join(
            struct.pack("<Q", d) for d in dims
        )

    payload = np.zeros(3, "<f4").tobytes()
    assert torch.equal(decode_delta(hdr() + payload), torch.zeros(3))
    _expect(hdr(magic=b"XXXX") + payload, Reason.MALFORMED)
    _expect(hdr(version=2) + payload, Reason.SCHEMA_VERSION)
    _expect(hdr(codec=9) + payload, Reason.MALFORMED)
    _expect(hdr(scale=7) + payload, Reason.MALFORMED)
    _expect(hdr(block=4) + payload, Reason.MALFORMED)  # fp32 takes no block
    _expect(hdr(codec=1, block=0) + payload, Reason.MALFORMED)  # int8 needs a block
    _expect(hdr(codec=1, block=1 << 20) + payload, Reason.MALFORMED)
    _expect(hdr(codec=2, nnz=4) + payload, Reason.MALFORMED)  # nnz > numel
    _expect(hdr(ndim=200, dims=[1] * 200), Reason.TOO_LARGE)
    # a 2**62-element claim in a few dozen bytes is refused before any allocation
    _expect(hdr(ndim=2, dims=[2**31, 2**31]) + payload, Reason.TOO_LARGE)
    _expect(hdr(dims=[1001]) + payload, Reason.TOO_LARGE, DecodeLimits(max_numel=1000))
    nan = np.array([0, np.nan, 0], "<f4").tobytes()
    _expect(hdr() + nan, Reason.MALFORMED)


def test_bad_payload_values_rejected() -> None:
    good = bytearray(
        Int8Block(block_size=4, scale_dtype="float32").encode(torch.tensor([1.0, -2.0, 3.0]))
    )
    off = DeltaHeader(CodecId.INT8_BLOCK, ScaleDtype.FLOAT32, (3,), 4).size
    bad = bytearray(good)
    bad[off + 4] = 0x80  # q = -128
    _expect(bytes(bad), Reason.MALFORMED)
    bad = bytearray(good)
    bad[off : off + 4] = struct.pack("<f", -1.0)  # negative scale
    _expect(bytes(bad), Reason.MALFORMED)
    bad[off : off + 4] = struct.pack("<f", float("inf"))
    _expect(bytes(bad), Reason.MALFORMED)
    bad[off : off + 4] = struct.pack("<f", 1e37)  # finite, but 127 steps of it are not
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before numpy overflows, or quietly
        _expect(bytes(bad), Reason.MALFORMED)
    top = bytearray(TopK(k=3, int8=False).encode(torch.tensor([5.0, 0.0, 6.0, 0.0, 7.0])))
    off = DeltaHeader(CodecId.TOPK_FP32, ScaleDtype.FLOAT32, (5,), 0, 3).size
    for idx in ([0, 0, 4], [2, 0, 4], [0, 2, 5]):  # duplicate, unsorted, out of range
        bad = bytearray(top)
        bad[off : off + 12] = np.array(idx, "<u4").tobytes()
        _expect(bytes(bad), Reason.MALFORMED)


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data: bytes) -> None:
    for candidate in (data, b"PTWD\x01" + data, b"PTSD\x01\0\0\0" + data):
        try:
            decode_delta(candidate)
        except DecodeError:
            pass
        try:
            decode_state_delta(candidate)
        except DecodeError:
            pass


@SETTINGS
@given(st.data())
def test_bit_flips_rejected_or_decoded_in_bounds(data: st.DataObject) -> None:
    """Integrity is the manifest digest's job; the codec only promises to stay in its limits."""
    limits = DecodeLimits(max_numel=100_000)
    good = bytearray(_good())
    pos = data.draw(st.integers(0, len(good) - 1))
    good[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        out = decode_delta(bytes(good), limits)
    except DecodeError:
        return
    assert out.numel() <= limits.max_numel and bool(torch.isfinite(out).all())


def test_apply_delta_refuses_mismatches() -> None:
    data = Fp32().encode(torch.ones(4))
    with pytest.raises(DecodeError) as info:
        apply_delta(torch.zeros(5), data)
    assert info.value.reason is Reason.INCONSISTENT
    with pytest.raises(ValueError):
        apply_delta(torch.zeros(4, dtype=torch.bfloat16), data)


# -- whole stage ------------------------------------------------------------------------


def test_state_blob_round_trip_and_checks() -> None:
    deltas = {"z": torch.ones(3), "a.b": torch.full((2, 2), -0.5), "é": torch.zeros(0)}
    blob = encode_state_delta(deltas, Fp32())
    assert [name for name, _ in split_state_delta(blob)] == sorted(deltas, key=str.encode)
    out = decode_state_delta(blob)
    assert all(torch.equal(out[k], v) for k, v in deltas.items())
    weights = {k: torch.zeros_like(v) for k, v in deltas.items()}
    assert all(torch.equal(apply_state_delta(weights, blob)[k], v) for k, v in deltas.items())
    with pytest.raises(DecodeError) as info:
        apply_state_delta({"z": torch.zeros(3)}, blob)
    assert info.value.reason is Reason.INCONSISTENT
    for cut in range(len(blob)):
        with pytest.raises(DecodeError):
            decode_state_delta(blob[:cut])
    with pytest.raises(DecodeError) as info:
        decode_state_delta(blob + b"x")
    assert info.value.reason is Reason.TRAILING_BYTES
    with pytest.raises(DecodeError) as info:
        decode_state_delta(blob, DecodeLimits(max_total_numel=5))
    assert info.value.reason is Reason.TOO_LARGE
    with pytest.raises(DecodeError) as info:
        decode_state_delta(blob, DecodeLimits(max_tensors=2))
    assert info.value.reason is Reason.TOO_LARGE
    # names out of order (swap the first two entries) are not canonical
    entries = split_state_delta(blob)
    swapped = blob[:12] + b"".join(
        struct.pack("<H", len(n.encode())) + n.encode() + struct.pack("<Q", len(p)) + bytes(p)
        for n, p in [entries[1], entries[0], entries[2]]
    )
    with pytest.raises(DecodeError) as info:
        decode_state_delta(swapped)
    assert info.value.reason is Reason.MALFORMED


def test_registry() -> None:
    assert set(CODECS) >= {"fp32", "none", "int8-block", "topk"}
    assert isinstance(get_codec("int8-block", block_size=128), Int8Block)
    assert get_codec("topk", fraction=0.01).name == "topk"
    with pytest.raises(ConfigError):
        get_codec("zstd")
    with pytest.raises(ConfigError):
        get_codec("topk", fraction=0.0)
    with pytest.raises(ConfigError):
        get_codec("int8-block", bogus=1)
    with pytest.raises(ValueError):
        Int8Block().encode(torch.tensor([float("nan")]))


# -- size -------------------------------------------------------------------------------


def test_compression_ratio_against_bfloat16() -> None:
    """A ~1M-parameter stage: int8-block alone is ~2x smaller than bf16, topk(2%)+int8 >= 10x."""
    gen = torch.Generator().manual_seed(0)
    deltas = {
        "embed.weight": torch.randn(512, 1024, generator=gen) * 1e-3,
        "block.0.mlp.weight": torch.randn(1024, 480, generator=gen) * 1e-3,
        "block.0.norm.weight": torch.randn(1024, generator=gen) * 1e-3,
    }
    numel = sum(v.numel() for v in deltas.values())
    assert 990_000 <= numel <= 1_100_000
    bf16_bytes = 2 * numel
    sizes = {
        name: len(encode_state_delta(deltas, codec))
        for name, codec in [
            ("fp32", Fp32()),
            ("int8-block", Int8Block()),
            ("topk-int8-2%", TopK(fraction=0.02)),
            ("topk-int8-1%", TopK(fraction=0.01)),
        ]
    }
    ratios = {k: bf16_bytes / v for k, v in sizes.items()}
    assert 0.49 < ratios["fp32"] <= 0.5
    assert 1.9 < ratios["int8-block"] <= 2.0
    assert ratios["topk-int8-2%"] >= 10.0
    assert ratios["topk-int8-1%"] >= 30.0


def test_learning_through_compressed_updates_matches_exact() -> None:
    """Least squares trained on the published (reconstructed) copy: topk-int8 + error
    feedback reaches about the loss of uncompressed updates."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(400, 2000, generator=gen) / 40
    target = a @ torch.randn(2000, generator=gen)

    def loss_grad(w: torch.Tensor) -> tuple[float, torch.Tensor]:
        err = a @ w - target
        return float((err**2).mean()), 2 * a.T @ err / len(err)

    exact = torch.zeros(2000)
    published = torch.zeros(2000)
    ef = ErrorFeedback()
    codec = TopK(fraction=0.05)
    start, _ = loss_grad(exact)
    for _ in range(150):
        exact = exact - 0.5 * loss_grad(exact)[1]
        published = apply_delta(published, ef.encode("w", -0.5 * loss_grad(published)[1], codec))
    final_exact, final_published = loss_grad(exact)[0], loss_grad(published)[0]
    assert final_exact < 0.5 * start
    assert final_published <= 1.1 * final_exact + 1e-3 * start


@pytest.mark.parametrize("scale", ["float32", "bfloat16", "float16"])
def test_encoding_in_place_chunk_by_chunk_matches_a_contributor(
    scale: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantised a few blocks at a time, the bytes and the values left behind are those of
    the reference encoder and a contributor's decoder, bit for bit, across chunk ends."""
    from verify import delta_quant

    monkeypatch.setattr(delta_quant, "CHUNK_VALUES", 3 * 64)  # 3 blocks a chunk, 1 left over
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(10 * 64, generator=gen) * 2 - 1) * torch.exp2(
        torch.randint(-20, 10, (10, 1), generator=gen).float()
    ).repeat_interleave(64, 0).flatten()
    x[7 * 64 : 8 * 64] = 0.0
    x[7 * 64 + 3] = 190 * 2.0**-149  # a subnormal scale: the float32 path clamps
    codec = Int8Block(scale_dtype=scale)  # type: ignore[arg-type]
    values = x.clone()
    pieces = codec.encode_decoded_(values)
    assert pieces is not None
    blob = b"".join(bytes(p) for p in pieces)
    assert blob == codec.encode(x.clone())
    weights = {"w": torch.zeros(10 * 64)}
    add_state_delta_(weights, encode_state_delta({"w": x.clone()}, codec))
    assert torch.equal(values.view(torch.int32), weights["w"].view(torch.int32))
