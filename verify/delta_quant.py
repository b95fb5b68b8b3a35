"""The numerics of weight deltas: blockwise int8 quantisation and payload arrays.

Invariants:

* Decoding is bit-identical on every machine: int8 -> float32 is exact, then
  one IEEE float32 multiply by the block scale; nothing is summed, fused or
  reordered. Scale conversions (bfloat16, float16 -> float32) are exact.
* The encoder rounds each scale *up* to its storage type and quantises against
  the stored scale, so |q| <= 127 without clipping and the decoder's product is
  exactly what the encoder meant.
* Decoders refuse non-canonical or hostile payloads with a
  :class:`~verify.errors.DecodeError`: non-finite values, negative or non-finite
  scales, q = -128, and indices that are not strictly increasing below numel.
  Payload lengths are checked by the caller (``parse_header``) beforehand.

Pure: bytes and arrays in, arrays or bytes out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from verify.aggregate_blocks import all_finite
from verify.delta_format import ScaleDtype, decode_error
from verify.errors import Reason


def n_blocks(n: int, block: int) -> int:
    """ceil(n / block): the number of scales for ``n`` values in blocks of ``block``."""
    return -(-n // block)


def quantize_int8(x: Tensor, block: int, scale_dtype: ScaleDtype) -> tuple[bytes, bytes]:
    """Blockwise absmax int8 of a 1-D float32 tensor -> (scale bytes, q bytes).

    Each scale is absmax/127 rounded *up* to ``scale_dtype``, and q is computed
    against that stored scale, so |q| <= 127 without clipping, the error is at most
    half a step, and the decoder's product is exactly what the encoder meant.
    """
    n = x.numel()
    nb = n_blocks(n, block)
    if n == nb * block:
        padded = x.reshape(-1)
    else:
        padded = torch.zeros(nb * block, dtype=torch.float32)
        padded[:n] = x
    blocks = padded.view(nb, block)  # (nb, B)
    scale = _stored_scale(blocks.abs().amax(dim=1), scale_dtype)
    q = blocks / _safe(scale)[:, None]
    q.round_().clamp_(-127, 127)
    return scale_dtype.pack(scale), q.to(torch.int8).flatten()[:n].numpy().tobytes()


def quantize_int8_(
    x: Tensor, block: int, scale_dtype: ScaleDtype
) -> tuple[bytes, np.ndarray] | None:
    """:func:`quantize_int8` of ``x`` (1-D float32, contiguous, a whole number of blocks)
    without a temporary the size of ``x``: returns (scale bytes, q as an int8 array) and
    leaves in ``x`` what :func:`dequantize_int8` decodes from them, bit for bit (int8 ->
    float32 is exact, then the same IEEE float32 multiply by the block's scale; a zero
    comes out as +0.0, as the int8 round trip gives it).

    Raises ValueError, with ``x`` unchanged, when ``x`` is not finite. Returns None, with
    ``x`` unchanged, when a block's scale is so large that a decoded value could overflow
    (``127 * scale`` above the float32 maximum): whether it does depends on the block's
    values, so those go through :func:`quantize_int8` and the decoder."""
    n = x.numel()
    if x.dtype != torch.float32 or not x.is_contiguous() or n % block:
        raise ValueError("in-place quantisation needs contiguous float32 whole blocks")
    blocks = x.view(n // block, block)
    rows = max(1, CHUNK_VALUES // block)  # blocks per chunk: each chunk's passes stay in cache
    chunks = [(a, min(a + rows, len(blocks))) for a in range(0, len(blocks), rows)]
    high, low = torch.empty(len(blocks)), torch.empty(len(blocks))
    for a, b in chunks:  # amax and amin: one pass each, faster than aminmax or abs().amax
        torch.amax(blocks[a:b], dim=1, out=high[a:b])
        torch.amin(blocks[a:b], dim=1, out=low[a:b])
    # max(high, -low) is |x|'s block maximum exactly; adding +0.0 turns a -0.0 into +0.0
    absmax = torch.maximum(high, low.neg_()).add_(0.0)
    scale = _stored_scale(absmax, scale_dtype)
    if not bool(torch.isfinite(scale).all()):  # amax and amin carry a NaN or infinity here
        raise ValueError("delta has non-finite values")
    if n and float(scale.max()) * 127.0 > float(torch.finfo(torch.float32).max):
        return None
    divisor = _safe(scale)
    clamp = _rounds_past_127(absmax, divisor)
    q = torch.empty((n // block, block), dtype=torch.int8)
    for a, b in chunks:
        part = blocks[a:b].div_(divisor[a:b, None]).round_()
        if clamp:
            part.clamp_(-127, 127)
        q[a:b].copy_(part)  # whole numbers in -127..127: the conversion is exact
        part.add_(0.0).mul_(scale[a:b, None])  # float32(q) * scale, as the decoder forms it
    return scale_dtype.pack(scale), q.view(-1).numpy()


CHUNK_VALUES = 1 << 17
"""Values per chunk of :func:`quantize_int8_` (512 KiB of float32: its passes over a chunk
read it from cache, not from memory)."""


def _stored_scale(absmax: Tensor, scale_dtype: ScaleDtype) -> Tensor:
    """absmax / 127 rounded *up* to ``scale_dtype``, as float32 (see :func:`quantize_int8`)."""
    scale = absmax / 127.0
    if scale_dtype is not ScaleDtype.FLOAT32:
        dt = scale_dtype.torch_dtype
        top = torch.finfo(dt).max
        low = scale.clamp(max=top).to(dt)
        up = torch.nextafter(low, torch.full_like(low, top))
        scale = torch.where(low.to(torch.float32) < scale, up, low).to(torch.float32)
    return scale


def _rounds_past_127(absmax: Tensor, divisor: Tensor) -> bool:
    """Whether some value of a block divided by the block's ``divisor`` rounds past 127.
    Division by a positive number is monotone, so ``|x| / divisor`` is at most
    ``absmax / divisor``; below 127.5 every quotient rounds to 127 at most and clamping
    changes nothing (the usual case: a scale rounded up from ``absmax / 127``). A scale
    that saturates its storage type or is a float32 subnormal can fall short of it."""
    return bool((absmax / divisor >= 127.5).any())


def _safe(scale: Tensor) -> Tensor:
    """The divisor of each block: its scale, or 1 where the scale is 0 (a block whose scale
    is 0 holds only zeros, so dividing it by 1 gives q = 0 there)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def dequantize_int8(buf: memoryview, n: int, block: int, scale_dtype: ScaleDtype) -> np.ndarray:
    """Inverse of :func:`quantize_int8`: float32 (n,) = float32(q) * float32(scale)."""
    nb = n_blocks(n, block)
    scales = scale_dtype.unpack(buf, nb)
    if not np.isfinite(scales).all() or np.signbit(scales).any():
        raise decode_error("block scale is negative or not finite", Reason.MALFORMED)
    q = np.frombuffer(buf, dtype=np.int8, count=n, offset=nb * scale_dtype.itemsize)
    if (q == -128).any():
        raise decode_error("int8 value -128 is not canonical", Reason.MALFORMED)
    with np.errstate(over="ignore"):
        out = q.astype(np.float32) * np.repeat(scales, block)[:n]
    if not np.isfinite(out).all():  # a scale the encoder cannot produce (above max / 127)
        raise decode_error("a dequantized value overflows float32", Reason.MALFORMED)
    return out


def values_f32(buf: memoryview, n: int, offset: int = 0) -> np.ndarray:
    """float32 (n,) read little-endian from ``buf`` at ``offset``; every value finite."""
    values = np.frombuffer(buf, dtype="<f4", count=n, offset=offset).astype(np.float32)
    if not np.isfinite(values).all():
        raise decode_error("delta value is not finite", Reason.MALFORMED)
    return values


def sparse_indices(buf: memoryview, nnz: int, numel: int) -> np.ndarray:
    """int64 (nnz,) from u32 little-endian; strictly increasing and below ``numel``."""
    idx = np.frombuffer(buf, dtype="<u4", count=nnz).astype(np.int64)
    if nnz and (idx[-1] >= numel or (np.diff(idx) <= 0).any()):
        raise decode_error("indices not strictly increasing below numel", Reason.MALFORMED)
    return idx


def as_f32(delta: Tensor) -> Tensor:
    """A finite floating-point delta as a contiguous 1-D float32 CPU tensor (ValueError otherwise)."""
    if not delta.is_floating_point():
        raise ValueError(f"delta must be floating point, got {delta.dtype}")
    x = delta.detach().to(device="cpu", dtype=torch.float32).contiguous().flatten()
    if not all_finite(x):
        raise ValueError("delta has non-finite values")
    return x
