"""Per-group gradients from one forward and one backward pass.

Robust aggregation needs one gradient per contributor. Running a separate
forward and backward per contributor costs a pass each, and on small batches
the fixed cost of a pass dominates. Rows of a decoder-only LM never interact
(attention stays inside a sequence, norms act per token), so one backward of
``sum_c loss_c`` gives every row exactly the activation gradients it gets from
its own contributor's loss; a parameter's per-contributor gradient is then
the sum of its per-token contributions over that contributor's rows.

:class:`GroupGradients` computes those sums with hooks, for the three kinds of
parameterised module a Llama-family stage holds:

- ``nn.Linear``: ``dW_c = sum_{t in c} g_t x_t^T`` and ``db_c = sum_{t in c} g_t``;
- ``nn.Embedding``: the rows of ``g`` added at the token ids of ``c``;
- RMS norms ``w * normalize(x)``: ``dw_c = sum_{t in c} g_t * normalize(x_t)``,
  used only when a probe confirms the module computes exactly that.

During the pass the parameters stop requiring gradients, so autograd computes
activation gradients only and no full-batch weight gradient is formed. A tied
parameter (embedding and output head) gets the sum of both modules' parts.
:func:`GroupGradients.plan` returns ``None`` for a stage holding any other
parameterised module; callers then fall back to one pass per contributor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    """``x / rms(x)`` in float32, back in ``x``'s dtype (the Llama RMSNorm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm_eps(module: nn.Module) -> float | None:
    """The epsilon of an RMS norm computing ``weight * normalize(x)``, or None."""
    weight = getattr(module, "weight", None)
    params = dict(module.named_parameters(recurse=False))
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or list(params) != ["weight"] or weight.dim() != 1 \
            or not isinstance(eps, float) or weight.device.type == "meta":
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn((3, weight.shape[0]), generator=gen).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            got = module(probe)
        except Exception:  # a module of unknown signature is simply not an RMS norm here
            return None
        want = weight * _rms_normalize(probe, eps)
    ok = isinstance(got, Tensor) and got.shape == want.shape and torch.equal(got, want)
    return eps if ok else None


_HandlerFn = Callable[["GroupGradients", Any, Tensor, Tensor, Any], None]
"""``handler(grads, module, module input, output gradient, arg)``: adds one module's part."""
_Handler = tuple[nn.Module, _HandlerFn, Any]


@dataclass(frozen=True)
class _Slot:
    """Where one parameter's gradient lives in the flat row."""

    start: int
    shape: torch.Size


class GroupGradients:
    """Per-group gradients of ``params`` (all owned by ``module``'s supported sub-modules).

    Use :meth:`plan` to build one; then, around one forward and backward of a
    batch whose rows are grouped into contiguous ``segments``::

        with grads.capture(segments, out):
            loss = sum(loss_of(rows) for rows in segments)
            loss.backward()

    ``out`` (n_groups, d) float32 receives row c = group c's gradient, laid
    out like ``trainer.rl.flat_grad(params)``.
    """

    def __init__(self, params: Sequence[nn.Parameter], handlers: list[_Handler]) -> None:
        self.params = list(params)
        self._handlers = handlers
        slots: dict[int, _Slot] = {}
        start = 0
        for p in self.params:
            slots[id(p)] = _Slot(start, p.shape)
            start += p.numel()
        self._slots = slots
        self.numel = start
        self._segments: list[tuple[int, int]] = []
        self._out: Tensor | None = None

    @classmethod
    def plan(cls, module: nn.Module, params: Sequence[nn.Parameter]) -> GroupGradients | None:
        """A plan covering every parameter in ``params``, or None if one is not covered."""
        handlers: list[_Handler] = []
        covered: set[int] = set()
        for sub in module.modules():
            own = list(sub.parameters(recurse=False))
            if not own:
                continue
            if type(sub) is nn.Linear:
                handlers.append((sub, cls._linear, None))
            elif type(sub) is nn.Embedding and sub.max_norm is None and not sub.sparse:
                handlers.append((sub, cls._embedding, sub.padding_idx))
            elif (eps := _norm_eps(sub)) is not None:
                handlers.append((sub, cls._rmsnorm, eps))
            else:
                return None
            covered.update(id(p) for p in own)
        if not all(id(p) in covered for p in params) or not params:
            return None
        return cls(params, handlers)

    @contextlib.contextmanager
    def capture(self, segments: Sequence[tuple[int, int]], out: Tensor) -> Iterator[None]:
        """Hooks on for one forward and backward: row c of ``out`` gets the gradient of
        the rows ``segments[c] = (lo, hi)`` (zeroed first)."""
        if out.shape != (len(segments), self.numel):
            raise ValueError(f"out must be {(len(segments), self.numel)}, got {tuple(out.shape)}")
        out.zero_()
        self._segments = [(int(lo), int(hi)) for lo, hi in segments]
        self._out = out
        flags = [p.requires_grad for p in self.params]
        handles = [sub.register_forward_hook(self._hook(handler, arg))
                   for sub, handler, arg in self._handlers]
        for p in self.params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for p, flag in zip(self.params, flags, strict=True):
                p.requires_grad_(flag)
            self._out = None

    # -- hooks

    def _view(self, p: Tensor, c: int) -> Tensor:
        assert self._out is not None
        slot = self._slots[id(p)]
        return self._out[c, slot.start: slot.start + p.numel()].view(slot.shape)

    def _tracked(self, p: Tensor | None) -> bool:
        return p is not None and id(p) in self._slots

    def _hook(self, handler: _HandlerFn, arg: Any):  # noqa: ANN202 - a forward hook
        def forward_hook(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> Tensor:
            x = inputs[0].detach()
            if not output.requires_grad:  # the first module of stage 0: gradients start here
                output = output.detach().requires_grad_()
            output.register_hook(lambda g: handler(self, module, x, g.detach(), arg))
            return output

        return forward_hook

    def _linear(self, module: nn.Linear, x: Tensor, g: Tensor, _: Any) -> None:
        weight, bias = self._tracked(module.weight), self._tracked(module.bias)
        for c, (lo, hi) in enumerate(self._segments):
            if hi <= lo:
                continue
            gc = g[lo:hi].reshape(-1, g.shape[-1]).float()
            if weight:
                xc = x[lo:hi].reshape(-1, x.shape[-1]).float()
                self._view(module.weight, c).addmm_(gc.t(), xc)
            if bias:
                self._view(module.bias, c).add_(gc.sum(0))

    def _embedding(self, module: nn.Embedding, ids: Tensor, g: Tensor, padding_idx: Any) -> None:
        if not self._tracked(module.weight):
            return
        for c, (lo, hi) in enumerate(self._segments):
            if hi <= lo:
                continue
            rows = ids[lo:hi].reshape(-1)
            gc = g[lo:hi].reshape(-1, g.shape[-1]).float()
            if padding_idx is not None:  # nn.Embedding gives its padding row no gradient
                gc = gc.masked_fill((rows == padding_idx)[:, None], 0.0)
            self._view(module.weight, c).index_add_(0, rows, gc)

    def _rmsnorm(self, module: nn.Module, x: Tensor, g: Tensor, eps: float) -> None:
        weight = module.weight
        if not isinstance(weight, Tensor) or not self._tracked(weight):
            return
        normed = _rms_normalize(x, eps)
        for c, (lo, hi) in enumerate(self._segments):
            if hi <= lo:
                continue
            part = (g[lo:hi].float() * normed[lo:hi].float()).reshape(-1, g.shape[-1]).sum(0)
            self._view(weight, c).add_(part)
