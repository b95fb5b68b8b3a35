"""Wire format of one encoded weight delta: header, ids, scale types, decode limits.

One encoded delta (little-endian, canonical)::

    magic "PTWD" | version u8 | codec u8 | scale dtype u8 | ndim u8
    | block size u32 | nnz u64 | ndim x dim u64 | payload

    fp32        values f32[numel]
    int8-block  scales (bf16|f16|f32)[ceil(numel/B)] | q i8[numel]
    topk        indices u32[nnz] (strictly increasing) | values f32[nnz]
    topk-int8   indices u32[nnz] | scales[ceil(nnz/B)] | q i8[nnz]

Invariants: :meth:`DeltaHeader.to_bytes` is the one function that writes a
header, and ``verify.delta_codecs.parse_header`` the one that reads it; the
codec and scale dtype ids below are wire values and never change meaning.
:class:`DecodeLimits` holds the caps a decoder checks before it allocates.
Pure: no I/O.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from verify.errors import DecodeError, Reason

MAGIC = b"PTWD"
FORMAT_VERSION = 1
HEAD = struct.Struct("<4sBBBBIQ")  # magic, version, codec, scale dtype, ndim, block, nnz
DIM = struct.Struct("<Q")


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
        head = HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            self.codec_id,
            self.scale_dtype,
            len(self.shape),
            self.block_size,
            self.nnz,
        )
        return head + b"".join(DIM.pack(d) for d in self.shape)

    @property
    def size(self) -> int:
        return HEAD.size + DIM.size * len(self.shape)


def decode_error(
    message: str, reason: Reason, expected: object = None, computed: object = None
) -> DecodeError:
    """The :class:`DecodeError` every refusal of delta bytes raises."""
    return DecodeError(message, reason=reason, expected=expected, computed=computed)
