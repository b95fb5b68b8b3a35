"""Compressed weight deltas: the bytes the trainer publishes after each step.

Every pipeline stage writes its update as a delta per parameter; contributors and
validators rebuild the policy by applying the chain of deltas to float32 weights.
Rebuilt weights must be bit-identical on every machine, so decoding uses only
exactly-rounded IEEE float32 element-wise operations (int8 -> float32 is exact,
then one multiply by the block scale, then one add to the weight); nothing is
summed, fused or reordered. (A process that flushes subnormals to zero, e.g. with
``torch.set_flush_denormal(True)``, can differ on subnormal values.)

One encoded delta (little-endian, canonical)::

    magic "PTWD" | version u8 | codec u8 | scale dtype u8 | ndim u8
    | block size u32 | nnz u64 | ndim x dim u64 | payload

    fp32        values f32[numel]
    int8-block  scales (bf16|f16|f32)[ceil(numel/B)] | q i8[numel]
    topk        indices u32[nnz] (strictly increasing) | values f32[nnz]
    topk-int8   indices u32[nnz] | scales[ceil(nnz/B)] | q i8[nnz]

Threat model: the bytes may come from anyone. ``parse_header`` checks magic,
version, codec, the shape against :class:`DecodeLimits` and the exact payload
length before anything is allocated; decoders then refuse non-finite values or
scales, q = -128 and unsorted, duplicate or out-of-range indices. Every refusal
is a :class:`DecodeError` with a reason.

Size per parameter, against 2 bytes for a bfloat16 copy: fp32 4; int8-block
1 + 2/B (about 2x smaller than bf16); topk-int8 at fraction p about 5p
(4-byte index + 1-byte value), so p = 2% is about 20x smaller than bf16.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from verify.errors import ConfigError, DecodeError, Reason

MAGIC = b"PTWD"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sBBBBIQ")  # magic, version, codec, scale dtype, ndim, block, nnz
_DIM = struct.Struct("<Q")


class CodecId(enum.IntEnum):
    FP32 = 0
    INT8_BLOCK = 1
    TOPK_FP32 = 2
    TOPK_INT8 = 3


class ScaleDtype(enum.IntEnum):
    """Storage type of int8 block scales. bfloat16 keeps float32's exponent range;
    float16 flushes scales below about 6e-8 (block absmax below about 8e-6) to zero."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is ScaleDtype.FLOAT32 else 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_SCALE[self]

    def pack(self, scales: Tensor) -> bytes:
        """Little-endian bytes of float32 scales that are exactly representable in this type."""
        if self is ScaleDtype.BFLOAT16:
            bits = scales.to(torch.bfloat16).view(torch.int16).numpy()
            return bits.astype("<i2").tobytes()
        return scales.numpy().astype("<f4" if self is ScaleDtype.FLOAT32 else "<f2").tobytes()

    def unpack(self, buf: memoryview, count: int) -> np.ndarray:
        """float32 (count,); every conversion is exact (bfloat16: the high half of a float32)."""
        if self is ScaleDtype.BFLOAT16:
            bits = np.frombuffer(buf, dtype="<u2", count=count).astype(np.uint32) << 16
            return bits.view(np.float32)
        dtype = "<f4" if self is ScaleDtype.FLOAT32 else "<f2"
        return np.frombuffer(buf, dtype=dtype, count=count).astype(np.float32)


_TORCH_SCALE = {
    ScaleDtype.FLOAT32: torch.float32,
    ScaleDtype.FLOAT16: torch.float16,
    ScaleDtype.BFLOAT16: torch.bfloat16,
}
ScaleName = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class DecodeLimits:
    """Caps a decoder checks before it allocates."""

    max_numel: int = 2**31 - 1
    """Elements in one tensor (indices are u32, so at most 2**32 - 1)."""
    max_ndim: int = 8
    max_block: int = 1 << 16
    max_tensors: int = 1 << 16
    """Entries in one state blob."""
    max_total_numel: int = 2**33
    """Elements summed over one state blob."""
    max_name_bytes: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.max_numel <= 2**32 - 1:
            raise ValueError("max_numel must fit a u32 index")


DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True)
class DeltaHeader:
    """The fixed header of one encoded delta. Invariant: consistent with its codec."""

    codec_id: CodecId
    scale_dtype: ScaleDtype
    shape: tuple[int, ...]
    block_size: int = 0
    nnz: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_bytes(self) -> bytes:
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            self.codec_id,
            self.scale_dtype,
            len(self.shape),
            self.block_size,
            self.nnz,
        )
        return head + b"".join(_DIM.pack(d) for d in self.shape)

    @property
    def size(self) -> int:
        return _HEAD.size + _DIM.size * len(self.shape)


def _fail(
    message: str, reason: Reason, expected: object = None, computed: object = None
) -> DecodeError:
    return DecodeError(message, reason=reason, expected=expected, computed=computed)


def parse_header(data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> DeltaHeader:
    """Parse and check the header, and check that the payload has exactly the right length."""
    buf = memoryview(data)
    if len(buf) < _HEAD.size:
        raise _fail("delta shorter than its header", Reason.TRUNCATED, _HEAD.size, len(buf))
    magic, version, codec, scale, ndim, block, nnz = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise _fail("not a weight delta", Reason.MALFORMED, MAGIC, bytes(magic))
    if version != FORMAT_VERSION:
        raise _fail("unknown delta format version", Reason.SCHEMA_VERSION, FORMAT_VERSION, version)
    if codec not in _BY_ID:
        raise _fail("unknown codec id", Reason.MALFORMED, sorted(_BY_ID), codec)
    if scale not in ScaleDtype.__members__.values():
        raise _fail("unknown scale dtype", Reason.MALFORMED, None, scale)
    if ndim > limits.max_ndim:
        raise _fail("too many dimensions", Reason.TOO_LARGE, limits.max_ndim, ndim)
    if len(buf) < _HEAD.size + _DIM.size * ndim:
        raise _fail("delta shorter than its shape", Reason.TRUNCATED)
    shape = tuple(_DIM.unpack_from(buf, _HEAD.size + _DIM.size * i)[0] for i in range(ndim))
    numel = 1
    for dim in shape:
        numel *= dim
        if numel > limits.max_numel:
            raise _fail("tensor too large", Reason.TOO_LARGE, limits.max_numel, shape)
    header = DeltaHeader(CodecId(codec), ScaleDtype(scale), shape, block, nnz)
    codec_impl = _BY_ID[header.codec_id]
    codec_impl.check_header(header, limits)
    want = header.size + codec_impl.payload_size(header)
    if len(buf) < want:
        raise _fail("delta payload truncated", Reason.TRUNCATED, want, len(buf))
    if len(buf) > want:
        raise _fail("bytes after the delta payload", Reason.TRAILING_BYTES, want, len(buf))
    return header


# -- blockwise int8 ---------------------------------------------------------------------


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def quantize_int8(x: Tensor, block: int, scale_dtype: ScaleDtype) -> tuple[bytes, bytes]:
    """Blockwise absmax int8 of a 1-D float32 tensor -> (scale bytes, q bytes).

    Each scale is absmax/127 rounded *up* to ``scale_dtype``, and q is computed
    against that stored scale, so |q| <= 127 without clipping, the error is at most
    half a step, and the decoder's product is exactly what the encoder meant.
    """
    n = x.numel()
    nb = _blocks(n, block)
    padded = torch.zeros(nb * block, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, block)  # (nb, B)
    scale = blocks.abs().amax(dim=1) / 127.0  # (nb,)
    if scale_dtype is not ScaleDtype.FLOAT32:
        dt = scale_dtype.torch_dtype
        top = torch.finfo(dt).max
        low = scale.clamp(max=top).to(dt)
        up = torch.nextafter(low, torch.full_like(low, top))
        scale = torch.where(low.to(torch.float32) < scale, up, low).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp(-127, 127)
    q = torch.where(scale[:, None] > 0, q, torch.zeros_like(q)).to(torch.int8).flatten()[:n]
    return scale_dtype.pack(scale), q.numpy().tobytes()


def dequantize_int8(buf: memoryview, n: int, block: int, scale_dtype: ScaleDtype) -> np.ndarray:
    """Inverse of :func:`quantize_int8`: float32 (n,) = float32(q) * float32(scale)."""
    nb = _blocks(n, block)
    scales = scale_dtype.unpack(buf, nb)
    if not np.isfinite(scales).all() or np.signbit(scales).any():
        raise _fail("block scale is negative or not finite", Reason.MALFORMED)
    q = np.frombuffer(buf, dtype=np.int8, count=n, offset=nb * scale_dtype.itemsize)
    if (q == -128).any():
        raise _fail("int8 value -128 is not canonical", Reason.MALFORMED)
    return q.astype(np.float32) * np.repeat(scales, block)[:n]


def _values_f32(buf: memoryview, n: int, offset: int = 0) -> np.ndarray:
    values = np.frombuffer(buf, dtype="<f4", count=n, offset=offset).astype(np.float32)
    if not np.isfinite(values).all():
        raise _fail("delta value is not finite", Reason.MALFORMED)
    return values


def _indices(buf: memoryview, nnz: int, numel: int) -> np.ndarray:
    idx = np.frombuffer(buf, dtype="<u4", count=nnz).astype(np.int64)
    if nnz and (idx[-1] >= numel or (np.diff(idx) <= 0).any()):
        raise _fail("indices not strictly increasing below numel", Reason.MALFORMED)
    return idx


def _as_f32(delta: Tensor) -> Tensor:
    if not delta.is_floating_point():
        raise ValueError(f"delta must be floating point, got {delta.dtype}")
    x = delta.detach().to(device="cpu", dtype=torch.float32).contiguous().flatten()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("delta has non-finite values")
    return x


# -- codecs -----------------------------------------------------------------------------


@runtime_checkable
class Codec(Protocol):
    """Encodes a float delta into canonical bytes; decoding is driven by the header alone."""

    @property
    def name(self) -> str: ...

    def encode(self, delta: Tensor) -> bytes: ...

    def check_header(self, header: DeltaHeader, limits: DecodeLimits) -> None:
        """Raise DecodeError unless the header's fields fit this codec."""
        ...

    def payload_size(self, header: DeltaHeader) -> int: ...

    def decode_payload(
        self, header: DeltaHeader, payload: memoryview
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """(indices or None for dense, float32 values); payload length already checked."""
        ...


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise _fail(message, Reason.MALFORMED)


@dataclass(frozen=True)
class Fp32:
    """Full-precision baseline: 4 bytes per element."""

    name: ClassVar[str] = "fp32"

    def encode(self, delta: Tensor) -> bytes:
        x = _as_f32(delta)
        head = DeltaHeader(CodecId.FP32, ScaleDtype.FLOAT32, tuple(delta.shape))
        return head.to_bytes() + x.numpy().astype("<f4").tobytes()

    def check_header(self, header: DeltaHeader, limits: DecodeLimits) -> None:
        _need(header.block_size == 0 and header.nnz == 0, "fp32 takes no block size or nnz")
        _need(header.scale_dtype is ScaleDtype.FLOAT32, "fp32 takes no scale dtype")

    def payload_size(self, header: DeltaHeader) -> int:
        return 4 * header.numel

    def decode_payload(
        self, header: DeltaHeader, payload: memoryview
    ) -> tuple[np.ndarray | None, np.ndarray]:
        return None, _values_f32(payload, header.numel)


def _check_block(block: int, limits: DecodeLimits) -> None:
    if not 1 <= block <= limits.max_block:
        raise _fail("block size out of range", Reason.MALFORMED, f"1..{limits.max_block}", block)


@dataclass(frozen=True)
class Int8Block:
    """Blockwise absmax int8: 1 byte per element plus one scale per block."""

    block_size: int = 64
    scale_dtype: ScaleName = "bfloat16"
    name: ClassVar[str] = "int8-block"

    def __post_init__(self) -> None:
        _check_block_param(self.block_size, self.scale_dtype)

    def encode(self, delta: Tensor) -> bytes:
        x = _as_f32(delta)
        sd = ScaleDtype[self.scale_dtype.upper()]
        head = DeltaHeader(CodecId.INT8_BLOCK, sd, tuple(delta.shape), self.block_size)
        scales, q = quantize_int8(x, self.block_size, sd)
        return head.to_bytes() + scales + q

    def check_header(self, header: DeltaHeader, limits: DecodeLimits) -> None:
        _check_block(header.block_size, limits)
        _need(header.nnz == 0, "int8-block takes no nnz")

    def payload_size(self, header: DeltaHeader) -> int:
        nb = _blocks(header.numel, header.block_size)
        return nb * header.scale_dtype.itemsize + header.numel

    def decode_payload(
        self, header: DeltaHeader, payload: memoryview
    ) -> tuple[np.ndarray | None, np.ndarray]:
        return None, dequantize_int8(payload, header.numel, header.block_size, header.scale_dtype)


def _check_block_param(block: int, scale_dtype: str) -> None:
    if not 1 <= block <= DEFAULT_LIMITS.max_block:
        raise ValueError(f"block_size must be in 1..{DEFAULT_LIMITS.max_block}, got {block}")
    if scale_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"scale_dtype must be bfloat16, float16 or float32, got {scale_dtype!r}")


@dataclass(frozen=True)
class TopK:
    """Top-k by magnitude: u32 indices plus values, as fp32 or (``int8=True``) blockwise int8.

    ``k`` elements, or ``ceil(fraction * numel)`` when k is not given (at least one
    element of a non-empty tensor). Everything else is dropped from this update;
    use :class:`ErrorFeedback` so it is sent later instead of lost.
    """

    fraction: float = 0.02
    k: int | None = None
    int8: bool = True
    block_size: int = 64
    scale_dtype: ScaleName = "bfloat16"
    name: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        _check_block_param(self.block_size, self.scale_dtype)

    def encode(self, delta: Tensor) -> bytes:
        x = _as_f32(delta)
        n = x.numel()
        k = min(n, self.k if self.k is not None else max(1, math.ceil(self.fraction * n)))
        idx = torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values
        vals = x[idx]
        idx_bytes = idx.numpy().astype("<u4").tobytes()
        if not self.int8:
            head = DeltaHeader(CodecId.TOPK_FP32, ScaleDtype.FLOAT32, tuple(delta.shape), 0, k)
            return head.to_bytes() + idx_bytes + vals.numpy().astype("<f4").tobytes()
        sd = ScaleDtype[self.scale_dtype.upper()]
        head = DeltaHeader(CodecId.TOPK_INT8, sd, tuple(delta.shape), self.block_size, k)
        scales, q = quantize_int8(vals, self.block_size, sd)
        return head.to_bytes() + idx_bytes + scales + q

    def check_header(self, header: DeltaHeader, limits: DecodeLimits) -> None:
        _need(header.nnz <= header.numel, "nnz exceeds numel")
        if header.codec_id is CodecId.TOPK_INT8:
            _check_block(header.block_size, limits)
        else:
            _need(header.block_size == 0, "topk fp32 takes no block size")
            _need(header.scale_dtype is ScaleDtype.FLOAT32, "topk fp32 takes no scale dtype")

    def payload_size(self, header: DeltaHeader) -> int:
        nnz = header.nnz
        if header.codec_id is CodecId.TOPK_FP32:
            return 8 * nnz
        return 4 * nnz + _blocks(nnz, header.block_size) * header.scale_dtype.itemsize + nnz

    def decode_payload(
        self, header: DeltaHeader, payload: memoryview
    ) -> tuple[np.ndarray | None, np.ndarray]:
        nnz = header.nnz
        idx = _indices(payload, nnz, header.numel)
        if header.codec_id is CodecId.TOPK_FP32:
            return idx, _values_f32(payload, nnz, offset=4 * nnz)
        rest = payload[4 * nnz :]
        return idx, dequantize_int8(rest, nnz, header.block_size, header.scale_dtype)


_BY_ID: dict[int, Codec] = {
    CodecId.FP32: Fp32(),
    CodecId.INT8_BLOCK: Int8Block(),
    CodecId.TOPK_FP32: TopK(int8=False),
    CodecId.TOPK_INT8: TopK(),
}

CODECS: dict[str, Callable[..., Codec]] = {
    "fp32": Fp32,
    "none": Fp32,
    "int8-block": Int8Block,
    "topk": TopK,
}


def get_codec(name: str, **params: object) -> Codec:
    """Build the codec registered as ``name``; ConfigError on a bad name or parameter."""
    if name not in CODECS:
        raise ConfigError(f"unknown codec {name!r}; known: {sorted(CODECS)}")
    try:
        return CODECS[name](**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"codec {name!r}: {exc}") from exc


# -- decoding and applying ----------------------------------------------------------------


def _decode_parts(
    data: bytes | memoryview, limits: DecodeLimits
) -> tuple[DeltaHeader, np.ndarray | None, np.ndarray]:
    header = parse_header(data, limits)
    payload = memoryview(data)[header.size :]
    idx, values = _BY_ID[header.codec_id].decode_payload(header, payload)
    return header, idx, values


def decode_delta(data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> Tensor:
    """Decode one delta into a dense float32 tensor of its shape."""
    header, idx, values = _decode_parts(data, limits)
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
    header, idx, values = _decode_parts(data, limits)
    if tuple(weights.shape) != header.shape:
        raise _fail(
            "delta shape differs from the weights",
            Reason.INCONSISTENT,
            tuple(weights.shape),
            header.shape,
        )
    out = weights.detach().to("cpu").contiguous().numpy().reshape(-1).copy()
    if idx is None:
        out = out + values
    else:
        out[idx] = out[idx] + values
    return torch.from_numpy(out).reshape(header.shape)


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
        target = _as_f32(delta).reshape(delta.shape)
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
    names = sorted(deltas, key=lambda s: s.encode())
    parts = [_STATE_HEAD.pack(STATE_MAGIC, FORMAT_VERSION, b"\0\0\0", len(names))]
    for name in names:
        raw = name.encode()
        if not 0 < len(raw) <= DEFAULT_LIMITS.max_name_bytes:
            raise ValueError(f"parameter name length must be 1..{DEFAULT_LIMITS.max_name_bytes}")
        data = (
            feedback.encode(name, deltas[name], codec) if feedback else codec.encode(deltas[name])
        )
        parts += [_NAME_LEN.pack(len(raw)), raw, _BLOB_LEN.pack(len(data)), data]
    return b"".join(parts)


def split_state_delta(
    blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> list[tuple[str, memoryview]]:
    """Parse a stage blob into (name, delta bytes), checking every header and limit first."""
    buf = memoryview(blob)
    if len(buf) < _STATE_HEAD.size:
        raise _fail("state delta shorter than its header", Reason.TRUNCATED)
    magic, version, pad, count = _STATE_HEAD.unpack_from(buf)
    if magic != STATE_MAGIC or pad != b"\0\0\0":
        raise _fail("not a state delta", Reason.MALFORMED, STATE_MAGIC, bytes(magic))
    if version != FORMAT_VERSION:
        raise _fail("unknown state delta version", Reason.SCHEMA_VERSION, FORMAT_VERSION, version)
    if count > limits.max_tensors:
        raise _fail("too many tensors", Reason.TOO_LARGE, limits.max_tensors, count)
    pos, total, prev = _STATE_HEAD.size, 0, b""
    entries: list[tuple[str, memoryview]] = []
    for _ in range(count):
        if len(buf) < pos + _NAME_LEN.size:
            raise _fail("state delta truncated", Reason.TRUNCATED)
        (name_len,) = _NAME_LEN.unpack_from(buf, pos)
        pos += _NAME_LEN.size
        if not 0 < name_len <= limits.max_name_bytes:
            raise _fail("parameter name length out of range", Reason.MALFORMED, None, name_len)
        if len(buf) < pos + name_len + _BLOB_LEN.size:
            raise _fail("state delta truncated", Reason.TRUNCATED)
        raw = bytes(buf[pos : pos + name_len])
        if raw <= prev:
            raise _fail("parameter names not strictly increasing", Reason.MALFORMED)
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail("parameter name is not UTF-8", Reason.MALFORMED) from None
        (size,) = _BLOB_LEN.unpack_from(buf, pos + name_len)
        pos += name_len + _BLOB_LEN.size
        if len(buf) < pos + size:
            raise _fail("state delta truncated", Reason.TRUNCATED, pos + size, len(buf))
        part = buf[pos : pos + size]
        total += parse_header(part, limits).numel
        if total > limits.max_total_numel:
            raise _fail("state delta too large", Reason.TOO_LARGE, limits.max_total_numel, total)
        entries.append((name, part))
        pos, prev = pos + size, raw
    if pos != len(buf):
        raise _fail("bytes after the state delta", Reason.TRAILING_BYTES, pos, len(buf))
    return entries


def decode_state_delta(
    blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> dict[str, Tensor]:
    """Dense float32 delta per parameter name."""
    return {name: decode_delta(part, limits) for name, part in split_state_delta(blob, limits)}


def apply_state_delta(
    weights: dict[str, Tensor], blob: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> dict[str, Tensor]:
    """New float32 weights for a stage; the blob must name exactly the weights' parameters."""
    entries = split_state_delta(blob, limits)
    names = {name for name, _ in entries}
    if names != set(weights):
        missing, extra = sorted(set(weights) - names), sorted(names - set(weights))
        raise _fail(
            "state delta names differ from the weights", Reason.INCONSISTENT, missing, extra
        )
    return {name: apply_delta(weights[name], part, limits) for name, part in entries}
