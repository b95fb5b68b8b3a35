"""Wire types: round-trips, canonical form, and limits enforced before allocation."""

from __future__ import annotations

import inspect
import tracemalloc

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify import types as T
from verify.errors import DecodeError, Reason

from .wire_strategies import ALL

BIG = 10**8


def test_every_wire_type_has_a_strategy_and_a_producer_consumer_comment() -> None:
    wire = {
        obj
        for _, obj in inspect.getmembers(T, inspect.isclass)
        if issubclass(obj, T._Wire) and obj is not T._Wire
    }
    assert wire == set(ALL)
    for cls in wire:
        doc = cls.__doc__ or ""
        if cls not in (T.SamplingParams, T.ShardEntry, T.RolloutHeader):
            assert "->" in doc, f"{cls.__name__} docstring must say producer -> consumer"


@pytest.mark.parametrize("cls", list(ALL), ids=lambda c: c.__name__)
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    obj = data.draw(ALL[cls])
    raw = T.canonical_bytes(obj)
    assert T.decode(cls, raw, max_bytes=BIG) == obj
    assert T.canonical_bytes(T.decode(cls, raw, max_bytes=BIG)) == raw


@pytest.mark.parametrize("cls", list(ALL), ids=lambda c: c.__name__)
@given(data=st.data())
def test_truncated_and_trailing_inputs_are_rejected(cls: type, data: st.DataObject) -> None:
    raw = T.canonical_bytes(data.draw(ALL[cls]))
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DecodeError) as exc:
        T.decode(cls, raw[:cut], max_bytes=BIG)
    assert exc.value.reason in {Reason.TRUNCATED, Reason.MALFORMED}
    garbage = data.draw(st.binary(min_size=1, max_size=16))
    with pytest.raises(DecodeError) as exc:
        T.decode(cls, raw + garbage, max_bytes=BIG)
    assert exc.value.reason is Reason.TRAILING_BYTES


@given(header=ALL[T.RolloutHeader])
def test_oversized_input_is_rejected_before_parsing(header: T.RolloutHeader) -> None:
    raw = T.canonical_bytes(header)
    with pytest.raises(DecodeError) as exc:
        T.decode(T.RolloutHeader, raw, max_bytes=len(raw) - 1)
    assert exc.value.reason is Reason.TOO_LARGE


def test_non_canonical_encoding_is_rejected() -> None:
    params = T.SamplingParams(1.0, 0.5, 3, 64, 9)
    raw = T.canonical_bytes(params)
    # Same values, temperature as a float32 instead of float64, top_k as a 32-bit int.
    variant = msgspec.msgpack.Encoder().encode([1.0, 0.5, 3, 64, 9, "icdf-v1"])
    assert variant == raw
    f32 = bytes([0x96, 0xCA]) + bytes.fromhex("3f800000") + raw[10:]
    assert T.decode(T.SamplingParams, f32, max_bytes=BIG, canonical=False) == params
    with pytest.raises(DecodeError, match="not canonical"):
        T.decode(T.SamplingParams, f32, max_bytes=BIG)
    tail = T.canonical_bytes("icdf-v1")
    wide_int = raw[: -1 - len(tail)] + bytes([0xCE]) + (9).to_bytes(4, "big") + tail
    with pytest.raises(DecodeError, match="not canonical"):
        T.decode(T.SamplingParams, wide_int, max_bytes=BIG)


def test_hostile_length_prefix_does_not_allocate() -> None:
    # An envelope whose header claims to be a 4 GiB bin32: the decoder must fail
    # on truncation without allocating anything near that size.
    hostile = bytes([0x93, 0xC6]) + (2**32 - 1).to_bytes(4, "big") + b"\x00" * 64
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError) as exc:
            T.decode(T.RolloutEnvelope, hostile, max_bytes=BIG)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.reason in {Reason.TRUNCATED, Reason.MALFORMED}
    assert peak < 1_000_000


def test_hard_caps_bound_lengths_even_when_bytes_are_present() -> None:
    body = T.RolloutBody(b"\x00" * (4 * T.MAX_TOKENS_HARD + 4), b"")
    raw = T.canonical_bytes(body)
    with pytest.raises(DecodeError) as exc:
        T.decode(T.RolloutBody, raw, max_bytes=BIG)
    assert exc.value.reason is Reason.MALFORMED
    assert "length" in str(exc.value)


def test_group_with_too_many_envelopes_is_rejected() -> None:
    env = T.RolloutEnvelope(b"h", b"s" * 64, T.RolloutBody(b"", b""))
    group = T.GroupSubmission(b"a" * 16, [env] * (T.MAX_GROUP_HARD + 1))
    with pytest.raises(DecodeError):
        T.decode(T.GroupSubmission, T.canonical_bytes(group), max_bytes=BIG)


def test_to_builtins_is_json_friendly() -> None:
    params = T.SamplingParams(0.7, 0.9, 40, 128, 5)
    shard = T.ShardEntry(1, b"\xab" * 32, "int8-block", 10, "delta")
    assert T.to_builtins(params) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "max_tokens": 128,
        "seed": 5,
        "sampler": "icdf-v1",
    }
    assert T.to_builtins(shard)["digest"] == "ab" * 32
