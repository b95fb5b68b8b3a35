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

Without the rows. :meth:`GroupGradients.capture_gram` keeps each module's
input and output gradient instead (activation-sized, whatever the number of
groups); :meth:`GroupGradients.gram` then forms the groups' Gram matrix
``K = R R^T`` (n, n) one block of parameter rows at a time, so at most
``n x GRAM_BLOCK`` gradient entries exist at once, and
:meth:`GroupGradients.combine` writes ``sum_c alpha_c R_c`` into ``.grad`` as
one weighted pass (each row's output gradient scaled by its group's alpha).
Memory: the model, the kept activations and ``O(n^2 + n * GRAM_BLOCK)``,
plus at most ``keep_bytes`` of per-group gradients (below): never ``n x d``
beyond that budget.

Forming K materialises every group's gradient of a parameter anyway (as much
work as the parameter's whole-batch weight gradient); the combine would form
it again. So :meth:`GroupGradients.gram` keeps the per-group gradients of the
parameters that fit in ``keep_bytes`` (``GRAM_KEEP_BYTES``, 1 GiB, by default; whole
parameters, in order, in buffers reused from step to step) and
:meth:`GroupGradients.combine` takes those as ``sum_c alpha_c R_c`` over the
kept rows (one pass over memory, no second product); only the parameters
beyond the budget are formed again. Same values up to float rounding either way.
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
    if (
        not isinstance(weight, nn.Parameter)
        or list(params) != ["weight"]
        or weight.dim() != 1
        or not isinstance(eps, float)
        or weight.device.type == "meta"
    ):
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


GRAM_BLOCK = 1 << 20
"""Gradient entries per group in one block of :meth:`GroupGradients.gram` (4 MiB float32)."""
GRAM_KEEP_BYTES = 1 << 30
"""Default budget of per-group gradients :meth:`GroupGradients.gram` keeps for
:meth:`GroupGradients.combine` (1 GiB float32: every group's gradient of a 33M-parameter
stage at 8 groups); 0 keeps none."""

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
        self._calls: list[_Call] | None = None  # capture_gram: what each module saw
        self.keep_bytes = GRAM_KEEP_BYTES
        """Budget of per-group gradients :meth:`gram` keeps for :meth:`combine` (bytes)."""
        self._kept: dict[int, Tensor] = {}  # param id -> (n_max, *shape) float32, reused
        self._formed: set[int] = set()  # params whose rows this pass's gram left in _kept

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
        self.reset(out)
        self._out = out
        with self._hooks(segments):
            yield

    @contextlib.contextmanager
    def capture_gram(self, segments: Sequence[tuple[int, int]]) -> Iterator[None]:
        """Hooks on for one forward and backward that keep what :meth:`gram` and
        :meth:`combine` need (see the module docstring)."""
        self._calls = []
        with self._hooks(segments):
            yield

    @contextlib.contextmanager
    def _hooks(self, segments: Sequence[tuple[int, int]]) -> Iterator[None]:
        self._segments = [(int(lo), int(hi)) for lo, hi in segments]
        flags = [p.requires_grad for p in self.params]
        handles = [
            sub.register_forward_hook(self._hook(handler, arg))
            for sub, handler, arg in self._handlers
        ]
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

    def reset(self, out: Tensor) -> None:
        """Zero the rows the hooks add into."""
        out.zero_()

    def gram(self) -> Tensor:
        """The groups' Gram matrix ``K[a, b] = <R_a, R_b>`` (n, n) float64 after a
        :meth:`capture_gram` pass, formed ``GRAM_BLOCK`` entries per group at a time (a
        parameter whose rows are kept for :meth:`combine`: at once, into its buffer)."""
        n = len(self._segments)
        k = torch.zeros((n, n), dtype=torch.float64)
        parts = _parts(self)
        self._formed = set()
        budget = self.keep_bytes
        for p in self.params:
            if id(p) not in parts:
                continue
            rows = p.shape[0] if p.dim() else 1
            size = 4 * n * p.numel()
            if size <= budget:
                budget -= size
                kept = self._kept_rows(p, n)
                fresh = [True] * n  # the first part of each group's row is written, not added
                for call, role in parts[id(p)]:
                    call.add(kept, role, 0, rows, fresh=fresh)
                for c in (c for c, f in enumerate(fresh) if f):
                    kept[c].zero_()  # a group with no tokens here
                flat = kept.reshape(n, -1)
                k += (flat @ flat.T).double()
                self._formed.add(id(p))
                continue
            step = max(1, GRAM_BLOCK // max(1, p.numel() // rows))
            for a in range(0, rows, step):
                b = min(a + step, rows)
                block = torch.zeros((n, b - a, *p.shape[1:]), dtype=torch.float32)
                for call, role in parts[id(p)]:
                    call.add(block, role, a, b)
                flat = block.reshape(n, -1)
                k += (flat @ flat.T).double()
        return k

    def combine(self, alpha: Tensor) -> None:
        """``p.grad = sum_c alpha_c R_c`` for every tracked parameter after a
        :meth:`capture_gram` pass; groups with alpha 0 are left out (a non-finite group
        cannot reach the result). Releases what the capture kept."""
        if alpha.shape != (len(self._segments),):
            raise ValueError(f"alpha must be ({len(self._segments)},), got {tuple(alpha.shape)}")
        scales = [float(a) for a in alpha]
        parts = _parts(self)
        for p in self.params:
            if id(p) in self._formed:
                p.grad = self._combine_kept(p, scales).to(p.dtype)
                continue
            grad = torch.zeros((1, *p.shape), dtype=torch.float32)
            for call, role in parts.get(id(p), []):
                call.add(grad, role, 0, p.shape[0] if p.dim() else 1, scales)
            p.grad = grad[0].to(p.dtype)
        self._calls = None
        self._formed = set()

    def _kept_rows(self, p: Tensor, n: int) -> Tensor:
        """(n, *p.shape) float32, uninitialised: ``p``'s kept per-group rows, in a buffer
        reused from step to step (a fresh one would be paged in again every step)."""
        buf = self._kept.get(id(p))
        if buf is None or buf.shape[0] < n:
            self._kept.pop(id(p), None)
            buf = self._kept[id(p)] = torch.empty((n, *p.shape), dtype=torch.float32)
        return buf[:n]

    def _combine_kept(self, p: Tensor, scales: Sequence[float]) -> Tensor:
        """``sum_c scales[c] * R_c`` from ``p``'s kept rows; rows scaled by 0 are left out (a
        non-finite row cannot reach the result: 0 * inf is NaN)."""
        rows = self._kept[id(p)][: len(scales)].reshape(len(scales), -1)
        live = [c for c, a in enumerate(scales) if a != 0.0]
        if len(live) == len(scales):
            weights = torch.tensor(scales, dtype=torch.float32)
            return torch.mv(rows.T, weights).view(p.shape)
        out = torch.zeros(p.numel(), dtype=torch.float32)
        for c in live:
            out.add_(rows[c], alpha=scales[c])
        return out.view(p.shape)

    # -- hooks

    def _view(self, p: Tensor, c: int) -> Tensor:
        assert self._out is not None
        slot = self._slots[id(p)]
        return self._out[c, slot.start : slot.start + p.numel()].view(slot.shape)

    def _tracked(self, p: Tensor | None) -> bool:
        return p is not None and id(p) in self._slots

    def _hook(self, handler: _HandlerFn, arg: Any):  # noqa: ANN202 - a forward hook
        def forward_hook(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> Tensor:
            x = inputs[0].detach()
            if not output.requires_grad:  # the first module of stage 0: gradients start here
                output = output.detach().requires_grad_()
            output.register_hook(lambda g: self._on_grad(handler, module, x, g.detach(), arg))
            return output

        return forward_hook

    def _on_grad(self, handler: _HandlerFn, module: Any, x: Tensor, g: Tensor, arg: Any) -> None:
        if self._calls is None:
            handler(self, module, x, g, arg)
            return
        if handler is GroupGradients._rmsnorm:
            x = _rms_normalize(x, arg)
        self._calls.append(_Call.keep(handler, module, x, g, arg, self._segments))

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


# -- without the rows: the Gram matrix, then one weighted pass


@dataclass(frozen=True)
class _Call:
    """One module call, per group: its token rows' input (RMS norms: the normalised input)
    and output gradient, flattened to ``(tokens, features)`` (views, no copies). Rows whose
    output gradient is zero (padding) add nothing and are kept anyway: finding and copying
    the live ones cost more than the products they saved."""

    handler: _HandlerFn
    module: nn.Module
    xs: list[Tensor]
    gs: list[Tensor]
    arg: Any

    @classmethod
    def keep(
        cls,
        handler: _HandlerFn,
        module: nn.Module,
        x: Tensor,
        g: Tensor,
        arg: Any,
        segments: Sequence[tuple[int, int]],
    ) -> _Call:
        xs, gs = [], []
        for lo, hi in segments:
            gc = g[lo:hi].reshape(-1, g.shape[-1])
            xc = (
                x[lo:hi].reshape(-1)
                if x.dim() == g.dim() - 1
                else x[lo:hi].reshape(-1, x.shape[-1])
            )
            xs.append(xc)
            gs.append(gc)
        return cls(handler, module, xs, gs, arg)

    def parts(self) -> list[tuple[nn.Parameter, str]]:
        names = ("weight", "bias") if self.handler is GroupGradients._linear else ("weight",)
        return [
            (p, n) for n in names if isinstance(p := getattr(self.module, n, None), nn.Parameter)
        ]

    def add(
        self,
        out: Tensor,
        role: str,
        a: int,
        b: int,
        scales: Sequence[float] | None = None,
        fresh: list[bool] | None = None,
    ) -> None:
        """Rows ``a:b`` of this call's part of parameter ``role``'s gradient: group c's into
        ``out[c]``, or with ``scales``, ``sum_c scales[c] * (group c's)`` into ``out[0]``.
        ``fresh[c]`` True: ``out[c]`` holds garbage, so write rather than add (then False)."""
        for c, (xc, gc) in enumerate(zip(self.xs, self.gs, strict=True)):
            scale = 1.0 if scales is None else scales[c]
            if not len(gc) or scale == 0.0:
                continue
            dst, gc = out[c if scales is None else 0], gc.float()
            if fresh is not None and fresh[c]:
                fresh[c] = False
                self._write(dst, role, xc, gc)
            elif self.handler is GroupGradients._embedding:
                keep = (xc >= a) & (xc < b)
                if self.arg is not None:  # nn.Embedding gives its padding row no gradient
                    keep &= xc != self.arg
                dst.index_add_(0, xc[keep] - a, gc[keep], alpha=scale)
            elif self.handler is GroupGradients._rmsnorm:
                dst.add_((gc * xc.float())[:, a:b].sum(0), alpha=scale)
            elif role == "bias":
                dst.add_(gc[:, a:b].sum(0), alpha=scale)
            else:
                dst.addmm_(gc[:, a:b].t(), xc.float(), alpha=scale)

    def _write(self, dst: Tensor, role: str, xc: Tensor, gc: Tensor) -> None:
        """Group's whole part (all rows of the parameter) written over ``dst``."""
        if self.handler is GroupGradients._embedding:
            dst.zero_()
            keep = xc != self.arg if self.arg is not None else slice(None)
            dst.index_add_(0, xc[keep], gc[keep])
        elif self.handler is GroupGradients._rmsnorm:
            torch.sum(gc * xc.float(), 0, out=dst)
        elif role == "bias":
            torch.sum(gc, 0, out=dst)
        else:
            torch.mm(gc.t(), xc.float(), out=dst)


def _parts(grads: GroupGradients) -> dict[int, list[tuple[_Call, str]]]:
    """Tracked parameter id -> the calls (and roles) that contributed to its gradient."""
    assert grads._calls is not None  # noqa: SLF001
    out: dict[int, list[tuple[_Call, str]]] = {}
    for call in grads._calls:  # noqa: SLF001
        for p, role in call.parts():
            if grads._tracked(p):  # noqa: SLF001
                out.setdefault(id(p), []).append((call, role))
    return out
