"""Compressed weight deltas: the bytes the trainer publishes after each step.

Every pipeline stage writes its update as a delta per parameter; contributors and
validators rebuild the policy by applying the chain of deltas to float32 weights.
Rebuilt weights must be bit-identical on every machine, so decoding uses only
exactly-rounded IEEE float32 element-wise operations (int8 -> float32 is exact,
then one multiply by the block scale, then one add to the weight); nothing is
summed, fused or reordered. (A process that flushes subnormals to zero, e.g. with
``torch.set_flush_denormal(True)``, can differ on subnormal values.)

This module decodes and applies single deltas and whole-stage blobs, and keeps
the encoder's error-feedback residuals. The pieces below it:

* ``verify.delta_format``: the byte layout of one delta (header, codec and
  scale dtype ids) and :class:`DecodeLimits`;
* ``verify.delta_quant``: blockwise int8 quantisation and payload arrays;
* ``verify.delta_codecs``: the :class:`Codec` protocol, its implementations,
  the registries and :func:`parse_header`.

Their public names are re-exported here; import them from this module.

Threat model: the bytes may come from anyone. ``parse_header`` checks magic,
version, codec, the shape against :class:`DecodeLimits` and the exact payload
length before anything is allocated; decoders then refuse non-finite values or
scales, q = -128 and unsorted, duplicate or out-of-range indices; stage blobs
are checked entry by entry before any delta is decoded. Every refusal is a
:class:`~verify.errors.DecodeError` with a reason.

Size per parameter, against 2 bytes for a bfloat16 copy: fp32 4; int8-block
1 + 2/B (about 2x smaller than bf16); topk-int8 at fraction p about 5p
(4-byte index + 1-byte value), so p = 2% is about 20x smaller than bf16.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from verify.delta_codecs import (
    CODECS,
    Codec,
    Fp32,
    Int8Block,
    TopK,
    decode_parts,
    get_codec,
    parse_header,
)
from verify.delta_format import (
    DEFAULT_LIMITS,
    FORMAT_VERSION,
    MAGIC,
    CodecId,
    DecodeLimits,
    DeltaHeader,
    ScaleDtype,
    ScaleName,
    decode_error,
)
from verify.delta_quant import as_f32, dequantize_int8, quantize_int8
from verify.errors import Reason

__all__ = [
    "CODECS",
    "DEFAULT_LIMITS",
    "FORMAT_VERSION",
    "MAGIC",
    "STATE_MAGIC",
    "Codec",
    "CodecId",
    "DecodeLimits",
    "DeltaHeader",
    "ErrorFeedback",
    "Fp32",
    "Int8Block",
    "ScaleDtype",
    "ScaleName",
    "TopK",
    "add_state_delta_",
    "apply_delta",
    "apply_state_delta",
    "decode_delta",
    "decode_state_delta",
    "dequantize_int8",
    "encode_state_delta",
    "encode_state_delta_applied_",
    "get_codec",
    "parse_header",
    "quantize_int8",
    "split_state_delta",
]

# -- decoding and applying ----------------------------------------------------------------


def decode_delta(data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> Tensor:
    """Decode one delta into a dense float32 tensor of its shape."""
    header, idx, values = decode_parts(data, limits)
    if idx is None:
        dense = values
    else:
        dense = np.zeros(header.numel, dtype=np.float32)
        dense[idx] = values
    return torch.from_numpy(dense).reshape(header.shape)


def apply_delta(
    weights: Tensor, data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> Tensor:
    """Return ``weights + delta`` as a new float32 tensor; bit-exact on every machine.

    ``weights`` must be float32 of the delta's shape (DecodeError INCONSISTENT
    otherwise). Each element is one IEEE float32 addition. The result is on the CPU.
    """
    if weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")
    idx, values = _decode_for(weights, data, limits)
    out = weights.detach().to("cpu").contiguous().numpy().reshape(-1).copy()
    if idx is None:
        out = out + values
    else:
        out[idx] = out[idx] + values
    return torch.from_numpy(out).reshape(weights.shape)


class ErrorFeedback:
    """Encoder-side residuals, one per parameter name (not thread-safe).

    ``encode(name, delta, codec)`` sends ``delta + residual`` and keeps as the new
    residual exactly what the receivers will not see (``sent - decode(bytes)``),
    so the sum of decoded deltas trails the sum of true deltas by the current
    residual only, which stays bounded instead of growing with the step count.
    """

    def __init__(self) -> None:
        self._residual: dict[str, Tensor] = {}

    def residual(self, name: str) -> Tensor | None:
        return self._residual.get(name)

    def encode(self, name: str, delta: Tensor, codec: Codec) -> bytes:
        target = as_f32(delta).reshape(delta.shape)
        prev = self._residual.get(name)
        if prev is not None:
            if prev.shape != target.shape:
                raise ValueError(f"residual for {name!r} has shape {tuple(prev.shape)}")
            target = target + prev
        data = codec.encode(target)
        self._residual[name] = target - decode_delta(data)
        return data

    def reset(self) -> None:
        self._residual.clear()


# -- a whole stage ----------------------------------------------------------------------
# "PTSD" | version u8 | 3 zero bytes | count u32 | count x (name_len u16 | name utf-8
# | delta_len u64 | delta), names strictly increasing as UTF-8 bytes.

STATE_MAGIC = b"PTSD"
_STATE_HEAD = struct.Struct("<4sB3sI")
_NAME_LEN = struct.Struct("<H")
_BLOB_LEN = struct.Struct("<Q")


def encode_state_delta(
    deltas: dict[str, Tensor], codec: Codec, feedback: ErrorFeedback | None = None
) -> bytes:
    """Encode a stage's deltas (ordered by parameter name) into one canonical blob."""
    entries = []
    for name in _ordered(deltas):
        raw = _name_bytes(name)
        data = (
            feedback.encode(name, deltas[name], codec) if feedback else codec.encode(deltas[name])
        )
        entries.append((raw, [data]))
    return _state_blob(entries)


def encode_state_delta_applied_(
    weights: dict[str, Tensor], deltas: dict[str, Tensor], codec: Codec
) -> bytes:
    """``encode_state_delta(deltas, codec)``, with ``weights`` advanced by the blob exactly
    as :func:`add_state_delta_` advances them, bit for bit.

    A codec that can leave its decoded values in the delta (``encode_decoded_``, such as
    ``Int8Block``) encodes each one in place, without decoding its own bytes again;
    ``deltas`` then hold those values. Every delta is encoded before any weight changes,
    so a delta that does not encode (ValueError) leaves ``weights`` as they were.
    """
    if set(deltas) != set(weights):
        raise ValueError("deltas and weights name different parameters")
    entries: list[tuple[bytes, list[bytes | memoryview]]] = []
    adds: list[tuple[Tensor, Tensor | bytes]] = []
    fused = getattr(codec, "encode_decoded_", None)
    for name in _ordered(deltas):
        raw, w, delta = _name_bytes(name), weights[name], deltas[name]
        _check_weight(name, w)
        if tuple(w.shape) != tuple(delta.shape):
            raise ValueError(f"{name}: delta shape {tuple(delta.shape)} differs from the weights")
        pieces = fused(delta) if fused is not None else None
        if pieces is None:
            data = codec.encode(delta)
            pieces = [data]
            adds.append((w, data))
        else:
            adds.append((w, delta))
        entries.append((raw, pieces))
    blob = _state_blob(entries)
    for w, values in adds:
        if isinstance(values, Tensor):
            w.view(-1).add_(values.view(-1))
        else:
            _add_part_(w, values, DEFAULT_LIMITS)
    return blob


def _ordered(deltas: dict[str, Tensor]) -> list[str]:
    """Parameter names in blob order: increasing as UTF-8 bytes."""
    return sorted(deltas, key=lambda s: s.encode())


def _state_blob(entries: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> bytes:
    """The stage blob of ``(name bytes, delta parts)`` entries, in blob order: each delta's
    parts are written one after the other, its length their total."""
    parts: list[bytes | memoryview] = [
        _STATE_HEAD.pack(STATE_MAGIC, FORMAT_VERSION, b"\0\0\0", len(entries))
    ]
    for raw, pieces in entries:
        size = sum(memoryview(p).nbytes for p in pieces)
        parts += [_NAME_LEN.pack(len(raw)), raw, _BLOB_LEN.pack(size), *pieces]
    return b"".join(parts)


def _name_bytes(name: str) -> bytes:
    raw = name.encode()
    if not 0 < len(raw) <= DEFAULT_LIMITS.max_name_bytes:
        raise ValueError(f"parameter name length must be 1..{DEFAULT_LIMITS.max_name_bytes}")
    return raw


def split_state_delta(
    blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> list[tuple[str, memoryview]]:
    """Parse a stage blob into (name, delta bytes), checking every header and limit first."""
    buf = memoryview(blob)
    if len(buf) < _STATE_HEAD.size:
        raise decode_error("state delta shorter than its header", Reason.TRUNCATED)
    magic, version, pad, count = _STATE_HEAD.unpack_from(buf)
    if magic != STATE_MAGIC or pad != b"\0\0\0":
        raise decode_error("not a state delta", Reason.MALFORMED, STATE_MAGIC, bytes(magic))
    if version != FORMAT_VERSION:
        raise decode_error(
            "unknown state delta version", Reason.SCHEMA_VERSION, FORMAT_VERSION, version
        )
    if count > limits.max_tensors:
        raise decode_error("too many tensors", Reason.TOO_LARGE, limits.max_tensors, count)
    pos, total, prev = _STATE_HEAD.size, 0, b""
    entries: list[tuple[str, memoryview]] = []
    for _ in range(count):
        if len(buf) < pos + _NAME_LEN.size:
            raise decode_error("state delta truncated", Reason.TRUNCATED)
        (name_len,) = _NAME_LEN.unpack_from(buf, pos)
        pos += _NAME_LEN.size
        if not 0 < name_len <= limits.max_name_bytes:
            raise decode_error(
                "parameter name length out of range", Reason.MALFORMED, None, name_len
            )
        if len(buf) < pos + name_len + _BLOB_LEN.size:
            raise decode_error("state delta truncated", Reason.TRUNCATED)
        raw = bytes(buf[pos : pos + name_len])
        if raw <= prev:
            raise decode_error("parameter names not strictly increasing", Reason.MALFORMED)
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise decode_error("parameter name is not UTF-8", Reason.MALFORMED) from None
        (size,) = _BLOB_LEN.unpack_from(buf, pos + name_len)
        pos += name_len + _BLOB_LEN.size
        if len(buf) < pos + size:
            raise decode_error("state delta truncated", Reason.TRUNCATED, pos + size, len(buf))
        part = buf[pos : pos + size]
        total += parse_header(part, limits).numel
        if total > limits.max_total_numel:
            raise decode_error(
                "state delta too large", Reason.TOO_LARGE, limits.max_total_numel, total
            )
        entries.append((name, part))
        pos, prev = pos + size, raw
    if pos != len(buf):
        raise decode_error("bytes after the state delta", Reason.TRAILING_BYTES, pos, len(buf))
    return entries


def decode_state_delta(
    blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> dict[str, Tensor]:
    """Dense float32 delta per parameter name."""
    return {name: decode_delta(part, limits) for name, part in split_state_delta(blob, limits)}


def add_state_delta_(
    weights: dict[str, Tensor], blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> None:
    """:func:`apply_state_delta` in place: each float32 CPU weight gets its delta added,
    with no second copy of the stage. Bit-identical to :func:`apply_state_delta`.

    For blobs the caller encoded itself (the publisher's own copy): names and every
    header are checked before any weight changes, but a payload refused halfway
    leaves the weights before it updated.
    """
    entries = split_state_delta(blob, limits)
    if {name for name, _ in entries} != set(weights):
        raise decode_error("state delta names differ from the weights", Reason.INCONSISTENT)
    for name, part in entries:
        _check_weight(name, weights[name])
        _add_part_(weights[name], part, limits)


def _decode_for(
    w: Tensor, part: bytes | memoryview, limits: DecodeLimits
) -> tuple[np.ndarray | None, np.ndarray]:
    """One delta's (indices or None, values), refused unless it has ``w``'s shape."""
    header, idx, values = decode_parts(part, limits)
    if tuple(w.shape) != header.shape:
        raise decode_error(
            "delta shape differs from the weights",
            Reason.INCONSISTENT,
            tuple(w.shape),
            header.shape,
        )
    return idx, values


def _check_weight(name: str, w: Tensor) -> None:
    if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        raise ValueError(f"{name}: weights must be contiguous float32 on the CPU")


def _add_part_(w: Tensor, part: bytes | memoryview, limits: DecodeLimits) -> None:
    """Add one delta's decoded values to the float32 CPU weight ``w`` in place."""
    idx, values = _decode_for(w, part, limits)
    flat = w.detach().numpy().reshape(-1)
    if idx is None:
        flat += values
    else:
        flat[idx] += values


def apply_state_delta(
    weights: dict[str, Tensor], blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> dict[str, Tensor]:
    """New float32 weights for a stage; the blob must name exactly the weights' parameters."""
    entries = split_state_delta(blob, limits)
    names = {name for name, _ in entries}
    if names != set(weights):
        missing, extra = sorted(set(weights) - names), sorted(names - set(weights))
        raise decode_error(
            "state delta names differ from the weights", Reason.INCONSISTENT, missing, extra
        )
    return {name: apply_delta(weights[name], part, limits) for name, part in entries}
