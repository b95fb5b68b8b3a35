"""Delta codecs: the :class:`Codec` protocol, its implementations and registries.

Two registries: :data:`CODECS` maps a config name to a codec factory (the
encoder's choice), and the wire registry maps each :class:`CodecId` to the codec
that decodes it, so decoding is driven by the header alone and never by a
setting. :func:`parse_header` checks magic, version, codec, the shape against
:class:`DecodeLimits` and the exact payload length before anything is
allocated; every refusal is a :class:`~verify.errors.DecodeError` with a reason.

Invariant: ``encode`` output is canonical (one byte string per input and
codec parameters) and decodes, under any codec instance with the same id, to
the values the encoder meant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from verify.delta_format import (
    DEFAULT_LIMITS,
    DIM,
    FORMAT_VERSION,
    HEAD,
    MAGIC,
    CodecId,
    DecodeLimits,
    DeltaHeader,
    ScaleDtype,
    ScaleName,
    decode_error,
)
from verify.delta_quant import (
    as_f32,
    dequantize_int8,
    n_blocks,
    quantize_int8,
    quantize_int8_,
    sparse_indices,
    values_f32,
)
from verify.errors import Reason, build_registered


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
        raise decode_error(message, Reason.MALFORMED)


@dataclass(frozen=True)
class Fp32:
    """Full-precision baseline: 4 bytes per element."""

    name: ClassVar[str] = "fp32"

    def encode(self, delta: Tensor) -> bytes:
        x = as_f32(delta)
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
        return None, values_f32(payload, header.numel)


def _check_block(block: int, limits: DecodeLimits) -> None:
    if not 1 <= block <= limits.max_block:
        raise decode_error(
            "block size out of range", Reason.MALFORMED, f"1..{limits.max_block}", block
        )


@dataclass(frozen=True)
class Int8Block:
    """Blockwise absmax int8: 1 byte per element plus one scale per block."""

    block_size: int = 64
    scale_dtype: ScaleName = "bfloat16"
    name: ClassVar[str] = "int8-block"

    def __post_init__(self) -> None:
        _check_block_param(self.block_size, self.scale_dtype)

    def encode(self, delta: Tensor) -> bytes:
        x = as_f32(delta)
        sd = ScaleDtype[self.scale_dtype.upper()]
        head = DeltaHeader(CodecId.INT8_BLOCK, sd, tuple(delta.shape), self.block_size)
        scales, q = quantize_int8(x, self.block_size, sd)
        return head.to_bytes() + scales + q

    def encode_decoded_(self, delta: Tensor) -> list[bytes | memoryview] | None:
        """:meth:`encode` of ``delta`` as byte parts (joined, they are ``encode(delta)``),
        leaving in ``delta`` the values a decoder forms from them, bit for bit. None, with
        ``delta`` untouched, unless it is contiguous float32 on the CPU and a whole number
        of blocks, or when a scale is near the float32 limit (``quantize_int8_``): the
        caller then encodes and decodes the usual way. ValueError, with ``delta``
        untouched, when it is not finite."""
        if (
            delta.dtype != torch.float32
            or delta.device.type != "cpu"
            or not delta.is_contiguous()
            or delta.numel() % self.block_size
        ):
            return None
        sd = ScaleDtype[self.scale_dtype.upper()]
        head = DeltaHeader(CodecId.INT8_BLOCK, sd, tuple(delta.shape), self.block_size)
        quantised = quantize_int8_(delta.view(-1), self.block_size, sd)
        if quantised is None:
            return None
        scales, q = quantised
        return [head.to_bytes(), scales, q.data]

    def check_header(self, header: DeltaHeader, limits: DecodeLimits) -> None:
        _check_block(header.block_size, limits)
        _need(header.nnz == 0, "int8-block takes no nnz")

    def payload_size(self, header: DeltaHeader) -> int:
        nb = n_blocks(header.numel, header.block_size)
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
    use :class:`~verify.weights_codec.ErrorFeedback` so it is sent later instead of lost.
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
        x = as_f32(delta)
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
        return 4 * nnz + n_blocks(nnz, header.block_size) * header.scale_dtype.itemsize + nnz

    def decode_payload(
        self, header: DeltaHeader, payload: memoryview
    ) -> tuple[np.ndarray | None, np.ndarray]:
        nnz = header.nnz
        idx = sparse_indices(payload, nnz, header.numel)
        if header.codec_id is CodecId.TOPK_FP32:
            return idx, values_f32(payload, nnz, offset=4 * nnz)
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
    return build_registered("codec", CODECS, name, params)


def parse_header(data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> DeltaHeader:
    """Parse and check the header, and check that the payload has exactly the right length."""
    buf = memoryview(data)
    if len(buf) < HEAD.size:
        raise decode_error("delta shorter than its header", Reason.TRUNCATED, HEAD.size, len(buf))
    magic, version, codec, scale, ndim, block, nnz = HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise decode_error("not a weight delta", Reason.MALFORMED, MAGIC, bytes(magic))
    if version != FORMAT_VERSION:
        raise decode_error(
            "unknown delta format version", Reason.SCHEMA_VERSION, FORMAT_VERSION, version
        )
    if codec not in _BY_ID:
        raise decode_error("unknown codec id", Reason.MALFORMED, sorted(_BY_ID), codec)
    if scale not in ScaleDtype.__members__.values():
        raise decode_error("unknown scale dtype", Reason.MALFORMED, None, scale)
    if ndim > limits.max_ndim:
        raise decode_error("too many dimensions", Reason.TOO_LARGE, limits.max_ndim, ndim)
    if len(buf) < HEAD.size + DIM.size * ndim:
        raise decode_error("delta shorter than its shape", Reason.TRUNCATED)
    shape = tuple(DIM.unpack_from(buf, HEAD.size + DIM.size * i)[0] for i in range(ndim))
    numel = 1
    for dim in shape:
        numel *= dim
        if numel > limits.max_numel:
            raise decode_error("tensor too large", Reason.TOO_LARGE, limits.max_numel, shape)
    header = DeltaHeader(CodecId(codec), ScaleDtype(scale), shape, block, nnz)
    codec_impl = _BY_ID[header.codec_id]
    codec_impl.check_header(header, limits)
    want = header.size + codec_impl.payload_size(header)
    if len(buf) < want:
        raise decode_error("delta payload truncated", Reason.TRUNCATED, want, len(buf))
    if len(buf) > want:
        raise decode_error("bytes after the delta payload", Reason.TRAILING_BYTES, want, len(buf))
    return header


def decode_parts(
    data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[DeltaHeader, np.ndarray | None, np.ndarray]:
    """(checked header, indices or None for dense, float32 values) of one encoded delta."""
    header = parse_header(data, limits)
    payload = memoryview(data)[header.size :]
    idx, values = _BY_ID[header.codec_id].decode_payload(header, payload)
    return header, idx, values
