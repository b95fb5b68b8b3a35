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
parameters that fit in ``keep_bytes`` (the trainer's ``aggregator.keep_gib``;
``GRAM_KEEP_BYTES``, 1 GiB, by default; whole
parameters, in order, in buffers reused from step to step) and
:meth:`GroupGradients.combine` takes those as ``sum_c alpha_c R_c`` over the
kept rows (one pass over memory, no second product); only the parameters
beyond the budget are formed again. Same values up to float rounding either way.

Without forming them at all. :meth:`GroupGradients.gram_sketch` estimates K
from a random sketch of each matrix parameter's per-group gradient: with
``A`` (rows x w) and ``B`` (columns x w) of independent N(0, 1/w) entries,
drawn afresh for every call, ``<A^T R_a B, A^T R_b B>`` is an unbiased
estimate of ``<R_a, R_b>``, and for a linear layer ``A^T R_c B = (G_c A)^T
(X_c B)``: two thin products over the tokens and one w x w product per group
instead of ``d_out x d_in`` per group. Parameters that read the same input (a
layer's query, key and value projections) share one ``B``, so ``X B`` is formed
once for all of them: each estimate keeps its expectation, so their sum is
still unbiased. Vectors (biases, norms) are formed exactly. The aggregator
then runs on the sketched vectors' exact Gram matrix, and
:meth:`GroupGradients.combine` forms ``sum_c alpha_c R_c`` exactly with one
weighted product per module call. Who chooses the samples cannot see
the sketch: it is drawn from the caller's generator after the batch is fixed.
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


def _inverse_rms(x: Tensor, eps: float) -> Tensor:
    """``1 / rms(x)`` per row of ``x`` (tokens, features), float32 (tokens,): the factor
    :func:`_rms_normalize` multiplies each row by, in one pass and without a copy of ``x``."""
    norm = torch.linalg.vector_norm(x.float(), dim=-1)
    return norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


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
        self._scratch: Tensor | None = None  # gram's block buffer, released after it

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
        :meth:`capture_gram` pass, formed ``GRAM_BLOCK`` entries per group at a time in one
        scratch buffer (a parameter whose rows are kept for :meth:`combine`: into its own
        buffer, block by block, each block's products taken while it is still in cache)."""
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
            kept = None
            if size <= budget:
                budget -= size
                kept = self._kept_rows(p, n)
                self._formed.add(id(p))
            per_row = max(1, p.numel() // rows)
            step = max(1, GRAM_BLOCK // per_row)
            for a in range(0, rows, step):
                b = min(a + step, rows)
                if kept is None:
                    block = self._scratch_block(n * (b - a) * per_row).view(n, b - a, *p.shape[1:])
                else:  # kept rows: formed in place, their products taken while still in cache
                    block = kept[:, a:b]
                k += _products(_form(parts[id(p)], block, a, b))
        self._scratch = None
        return k

    def gram_sketch(self, width: int, generator: torch.Generator) -> Tensor:
        """An unbiased estimate of :meth:`gram` (n, n) float64 after a :meth:`capture_gram`
        pass, from a ``width`` x ``width`` sketch of every matrix parameter's per-group
        gradient (see the module docstring); vector parameters exactly. Nothing is kept:
        :meth:`combine` forms the weighted gradient from the captured calls."""
        if width < 1:
            raise ValueError(f"sketch width must be >= 1, got {width}")
        n = len(self._segments)
        k = torch.zeros((n, n), dtype=torch.float64)
        parts = _parts(self)
        self._formed = set()
        scale = width**-0.5
        rights: dict[tuple, Tensor] = {}
        projected: dict[tuple, Tensor] = {}  # each input's product with its right, once
        for p in self.params:
            if id(p) not in parts:
                continue
            if p.dim() < 2:
                rows = p.shape[0] if p.dim() else 1
                block = self._scratch_block(n * p.numel()).view(n, *p.shape)
                k += _products(_form(parts[id(p)], block, 0, rows))
                continue
            left = torch.randn((p.shape[0], width), generator=generator).mul_(scale)
            inputs = (p[0].numel(), *(call.input_key for call, _ in parts[id(p)]))
            right = rights.get(inputs)
            if right is None:  # parameters that read the same inputs share one
                right = rights[inputs] = torch.randn(
                    (p[0].numel(), width), generator=generator
                ).mul_(scale)
            sketch = torch.zeros((n, width, width), dtype=torch.float32)
            for call, _role in parts[id(p)]:  # a matrix parameter has the "weight" role only
                call.sketch(sketch, left, right, projected)
            k += _products(sketch.reshape(n, -1))
        self._scratch = None
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
            grad: Tensor | None = None
            for call, role in parts.get(id(p), []):
                part = call.weighted(role, scales, p.shape)
                grad = part if grad is None else grad.add_(part)
            p.grad = (grad if grad is not None else torch.zeros(p.shape)).to(p.dtype)
        self._calls = None
        self._formed = set()

    def _scratch_block(self, numel: int) -> Tensor:
        """``numel`` uninitialised float32 entries of one scratch buffer reused within a
        :meth:`gram` (a fresh block per parameter would be paged in again every time)."""
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = None
            self._scratch = torch.empty(numel, dtype=torch.float32)
        return self._scratch[:numel]

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


PRODUCT_CHUNK = 1 << 14
"""Columns per product in :func:`_products` (a long, skinny ``(n, B) @ (B, n)`` runs at about
half the speed of the same product in chunks that stay in cache)."""


def _products(flat: Tensor) -> Tensor:
    """``flat @ flat.T`` (n, n) float64 of (n, B) float32 rows, in column chunks."""
    n, width = flat.shape
    acc = torch.zeros((n, n), dtype=torch.float32)
    for a in range(0, width, PRODUCT_CHUNK):
        part = flat[:, a : a + PRODUCT_CHUNK]
        acc.addmm_(part, part.t())
    return acc.double()


def _form(parts: list[tuple[_Call, str]], out: Tensor, a: int, b: int) -> Tensor:
    """Rows ``a:b`` of every group's gradient of one parameter written over ``out`` (n, b - a,
    ...), uninitialised on entry; returns it as (n, (b - a) * ...)."""
    n = out.shape[0]
    fresh = [True] * n  # the first part of each group's row is written, not added
    for call, role in parts:
        call.add(out, role, a, b, fresh=fresh)
    for c in (c for c, f in enumerate(fresh) if f):
        out[c].zero_()  # a group with no tokens here
    return out.reshape(n, -1)


@dataclass(frozen=True)
class _Call:
    """One module call: its token rows' input ``x`` (embeddings: the token ids) and output
    gradient ``g``, flattened to ``(tokens, features)``, and each group's token span; for
    an RMS norm, ``scale`` holds each token's ``1 / rms(x)`` (tokens,), so its normalised
    input is ``x * scale[:, None]`` without a copy of it being kept. Rows whose output
    gradient is zero (padding) add nothing and are kept anyway: finding and copying the
    live ones cost more than the products they saved."""

    handler: _HandlerFn
    module: nn.Module
    x: Tensor
    g: Tensor
    spans: list[tuple[int, int]]
    arg: Any
    scale: Tensor | None = None

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
        per_row = g[:1].numel() // g.shape[-1]  # tokens per batch row
        gf = g.reshape(-1, g.shape[-1])
        xf = x.reshape(-1) if x.dim() == g.dim() - 1 else x.reshape(-1, x.shape[-1])
        spans = [(lo * per_row, hi * per_row) for lo, hi in segments]
        scale = _inverse_rms(xf, arg) if handler is GroupGradients._rmsnorm else None
        return cls(handler, module, xf, gf, spans, arg, scale)

    @property
    def xs(self) -> list[Tensor]:
        return [self.x[lo:hi] for lo, hi in self.spans]

    @property
    def gs(self) -> list[Tensor]:
        return [self.g[lo:hi] for lo, hi in self.spans]

    @property
    def input_key(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Where this call's input lives: calls that read one tensor (a layer's query, key
        and value projections) have the same key while the capture holds them all."""
        return (self.x.data_ptr(), tuple(self.x.shape), tuple(self.x.stride()))

    def parts(self) -> list[tuple[nn.Parameter, str]]:
        names = ("weight", "bias") if self.handler is GroupGradients._linear else ("weight",)
        return [
            (p, n) for n in names if isinstance(p := getattr(self.module, n, None), nn.Parameter)
        ]

    def add(self, out: Tensor, role: str, a: int, b: int, fresh: list[bool]) -> None:
        """Rows ``a:b`` of this call's part of parameter ``role``'s gradient, group c's into
        ``out[c]``: written over it while ``fresh[c]`` (then False), else added."""
        for c, ((lo, hi), xc, gc) in enumerate(zip(self.spans, self.xs, self.gs, strict=True)):
            if not len(gc):
                continue
            dst, gc = out[c], gc.float()
            rc = None if self.scale is None else self.scale[lo:hi]
            if fresh[c] and self.handler is not GroupGradients._embedding:
                fresh[c] = False
                self._part(dst, role, xc, gc, rc, a, b, write=True)
                continue
            if fresh[c]:
                fresh[c] = False
                dst.zero_()
            self._part(dst, role, xc, gc, rc, a, b, write=False)

    def _part(
        self,
        dst: Tensor,
        role: str,
        xc: Tensor,
        gc: Tensor,
        rc: Tensor | None,
        a: int,
        b: int,
        *,
        write: bool,
    ) -> None:
        """Rows ``a:b`` of the part of tokens ``xc``/``gc`` (RMS norms: scaled per token by
        ``rc``), into (``write``: over) ``dst``."""
        if self.handler is GroupGradients._embedding:
            keep = (xc >= a) & (xc < b)
            if self.arg is not None:  # nn.Embedding gives its padding row no gradient
                keep &= xc != self.arg
            dst.index_add_(0, xc[keep] - a, gc[keep])
        elif self.handler is GroupGradients._rmsnorm:
            assert rc is not None
            part = gc[:, a:b] * xc[:, a:b].float()
            torch.mv(part.t(), rc, out=dst) if write else dst.add_(torch.mv(part.t(), rc))
        elif role == "bias":
            torch.sum(gc[:, a:b], 0, out=dst) if write else dst.add_(gc[:, a:b].sum(0))
        elif write:
            torch.mm(gc[:, a:b].t(), xc.float(), out=dst)
        else:
            dst.addmm_(gc[:, a:b].t(), xc.float())

    def sketch(
        self, out: Tensor, left: Tensor, right: Tensor, projected: dict[tuple, Tensor]
    ) -> None:
        """Add ``left^T R_c right`` to ``out[c]`` (n, w, w) for this call's part ``R_c`` of a
        matrix parameter's gradient (linear weight: ``R_c = G_c^T X_c``; embedding: the rows
        of ``G_c`` added at the token ids of ``c``). ``projected`` keeps ``X right`` for the
        other calls that read the same input with the same ``right``."""
        if self.handler is GroupGradients._embedding:
            for c, (lo, hi) in enumerate(self.spans):
                ids, g = self.x[lo:hi], self.g[lo:hi].float()
                if self.arg is not None:  # nn.Embedding gives its padding row no gradient
                    live = ids != self.arg
                    ids, g = ids[live], g[live]
                if len(ids):
                    out[c].addmm_(left[ids].t(), g @ right)
            return
        key = (*self.input_key, id(right))
        xb = projected.get(key)
        if xb is None:
            xb = projected[key] = self.x.float() @ right
        ga = self.g.float() @ left  # (tokens, w), as xb
        for c, (lo, hi) in enumerate(self.spans):
            if hi > lo:
                out[c].addmm_(ga[lo:hi].t(), xb[lo:hi])

    def weighted(self, role: str, scales: Sequence[float], shape: torch.Size) -> Tensor:
        """This call's part of parameter ``role``'s ``sum_c scales[c] * (group c's gradient)``
        as a new tensor of ``shape``: every token scaled by its group's scale (its input or
        its output gradient, whichever is narrower), then one product over all tokens.
        Groups scaled by 0 are left out, token and all (0 * inf is NaN: a non-finite group
        cannot reach the result)."""
        counts = [hi - lo for lo, hi in self.spans]
        weights = torch.tensor(scales, dtype=torch.float32)
        rows: slice | Tensor
        if (
            all(s != 0.0 for s in scales)
            and self.spans[0][0] == 0
            and all(self.spans[i][1] == self.spans[i + 1][0] for i in range(len(self.spans) - 1))
        ):
            rows = slice(0, self.spans[-1][1])
            w = torch.repeat_interleave(weights, torch.tensor(counts))
        else:
            live = [c for c, s in enumerate(scales) if s != 0.0 and counts[c]]
            rows = torch.cat(
                [torch.arange(*self.spans[c]) for c in live] or [torch.zeros(0, dtype=torch.long)]
            )
            w = torch.repeat_interleave(weights[live], torch.tensor([counts[c] for c in live]))
        x, g = self.x[rows], self.g[rows].float()
        if self.handler is GroupGradients._embedding:
            out = torch.zeros(shape, dtype=torch.float32)
            keep = x != self.arg if self.arg is not None else slice(None)
            return out.index_add_(0, x[keep], (g * w[:, None])[keep])
        if self.handler is GroupGradients._rmsnorm:
            assert self.scale is not None
            return torch.mv((g * x.float()).t(), w * self.scale[rows]).view(shape)
        if role == "bias":
            return torch.mv(g.t(), w).view(shape)
        x = x.float()
        if x.shape[1] < g.shape[1]:  # scale the narrower side of the product: fewer writes
            return (g.t() @ (x * w[:, None])).view(shape)
        return ((g * w[:, None]).t() @ x).view(shape)


def _parts(grads: GroupGradients) -> dict[int, list[tuple[_Call, str]]]:
    """Tracked parameter id -> the calls (and roles) that contributed to its gradient."""
    assert grads._calls is not None  # noqa: SLF001
    out: dict[int, list[tuple[_Call, str]]] = {}
    for call in grads._calls:  # noqa: SLF001
        for p, role in call.parts():
            if grads._tracked(p):  # noqa: SLF001
                out.setdefault(id(p), []).append((call, role))
    return out
