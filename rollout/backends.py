"""Generation backends: G completions of one prompt with the verifiable sampler.

Every backend returns, per completion, the sampled token ids and the committed
float32 logprobs, where ``logprobs[t]`` is exactly the processed logprob
(``verify.sampling.process_logits``) of ``token_ids[t]`` under the distribution
it was sampled from, and ``token_ids[t]`` is the draw of the request's
verifiable sampler (``verify.samplers``; by default the inverse-CDF sample at
``icdf_uniform(sampler_key, nonce, seed, t, sample_index=g)``). A validator
that recomputes the same distribution replays every token.

Backends are registered by name (:func:`register_backend`, :func:`make_backend`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rollout.loading import load_pretrained_lm
from verify.errors import ConfigError
from verify.samplers import DEFAULT_SAMPLER, sampler_named
from verify.sampling import SAMPLER_KEY_SIZE, check_params, process_logits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, ``group_size`` completions, the claimed sampling parameters."""

    prompt_ids: tuple[int, ...]
    group_size: int
    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    sampler_key: bytes
    """32 bytes; the contributor's public key."""
    nonce: bytes
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a completion ends after it samples one of these (included)."""
    sampler: str = DEFAULT_SAMPLER
    """The verifiable sampler the assignment names (``verify.samplers``)."""

    def __post_init__(self) -> None:
        check_params(self.temperature, self.top_k, self.top_p)
        sampler_named(self.sampler)
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.group_size < 1 or self.max_tokens < 1:
            raise ValueError("group_size and max_tokens must be >= 1")
        if len(self.sampler_key) != SAMPLER_KEY_SIZE:
            raise ValueError(f"sampler_key must be {SAMPLER_KEY_SIZE} bytes")


@dataclass(frozen=True, eq=False)
class GeneratedCompletion:
    """One completion: token ids and committed float32 logprobs, same length."""

    group_index: int
    token_ids: tuple[int, ...]
    logprobs: np.ndarray = field(repr=False)
    """float32 ``(len(token_ids),)``, read-only."""
    finish_reason: str
    """``"stop"`` (sampled a stop token) or ``"length"`` (hit ``max_tokens``)."""


class GenerationBackend(Protocol):
    """Generates the G completions of one assignment."""

    name: str
    precision: str
    """The dtype it generates in (``float32``, ``bfloat16``, ``float16``): what a contributor
    declares in its headers, and the tolerance its logprobs are held to."""

    def generate(self, request: GenerationRequest) -> list[GeneratedCompletion]:
        """Completions ``0 .. group_size - 1``, in group order."""
        ...


def batch_key(request: GenerationRequest) -> tuple:
    """What requests batched into one pass share: group size, sampling, length limit, stops."""
    return (
        request.group_size,
        request.temperature,
        request.top_k,
        request.top_p,
        request.max_tokens,
        tuple(sorted(set(request.stop_token_ids))),
        request.sampler,
    )


def generate_grouped(
    jobs: Sequence[tuple[int, GenerationRequest]],
    backend: Callable[[int], TransformersBackend],
    *,
    min_batch: int = 1,
) -> list[tuple[list[GeneratedCompletion], float] | None]:
    """Each ``(policy version, request)``'s completions and its share of its batch's seconds.

    Requests of one version and one :func:`batch_key` run as one
    ``backend(version).generate_batch``; a batch's wall time is shared by rows.
    Requests whose batch would hold fewer than ``min_batch`` get None.
    """
    batches: dict[tuple, list[int]] = {}
    for i, (version, req) in enumerate(jobs):
        batches.setdefault((version, batch_key(req)), []).append(i)
    out: list[tuple[list[GeneratedCompletion], float] | None] = [None] * len(jobs)
    for (version, _), idx in batches.items():
        if len(idx) < min_batch:
            continue
        start = time.perf_counter()
        groups = backend(version).generate_batch([jobs[i][1] for i in idx])
        spent = time.perf_counter() - start
        rows = sum(jobs[i][1].group_size for i in idx)
        for i, completions in zip(idx, groups, strict=True):
            out[i] = (completions, spent * jobs[i][1].group_size / rows)
    return out


BackendFactory = Callable[..., GenerationBackend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Class decorator: make a backend constructible by ``make_backend(name, ...)``."""

    def wrap(factory: BackendFactory) -> BackendFactory:
        if name in _REGISTRY:
            raise ValueError(f"generation backend {name!r} already registered")
        _REGISTRY[name] = factory
        return factory

    return wrap


def loads_from_directory(name: str) -> bool:
    """Whether backend ``name`` takes only a model directory (not an in-memory module); its
    class says so with ``loads_from_directory = True``."""
    return bool(getattr(_REGISTRY.get(name), "loads_from_directory", False))


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def make_backend(name: str, **kwargs: Any) -> GenerationBackend:
    """Construct a registered backend; unknown names raise ``ConfigError``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown generation backend {name!r}; available: {', '.join(available_backends())}"
        ) from None
    return factory(**kwargs)


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``"float32"``/``"bfloat16"``/``"float16"`` or a torch dtype; None keeps the model's."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def precision_name(dtype: torch.dtype) -> str:
    """The declared name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"generation in {dtype} is not supported; use one of {sorted(_DTYPES)}")


def load_causal_lm(
    model: torch.nn.Module | str | Path, device: str | torch.device, dtype: torch.dtype | None
) -> torch.nn.Module:
    """A ready ``transformers`` causal LM in eval mode, from a module or a local directory."""
    if isinstance(model, (str, Path)):
        model = load_pretrained_lm(model, dtype=dtype or "auto")
    elif dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


def left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded to one width: token ids, attention mask and position ids
    (each row's first real token at position 0), all ``(len(prompts), width)`` on the CPU."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward keyword (and output field) of the KV cache: ``cache`` in transformers 5."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@register_backend("transformers")
class TransformersBackend:
    """Batched KV-cached generation with a ``transformers`` causal LM (CPU or GPU).

    The prompt is encoded once and its cache repeated G times; then each step
    feeds the G last tokens (finished rows keep feeding their stop token and
    are ignored), so every row always has the same length and needs neither
    padding nor explicit position ids.

    ``share_prefill=False`` encodes the prompt once per completion instead (G
    rows of the same prompt, each with its own cache), as a generator without
    prefix sharing does: the same tokens and sampler, G times the prefill
    work. Benchmarks use it to compare with such generators on equal terms.
    """

    name = "transformers"

    def __init__(
        self,
        model: torch.nn.Module | str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        share_prefill: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_causal_lm(model, self.device, resolve_dtype(dtype))
        self.precision = precision_name(next(self.model.parameters()).dtype)
        self._cache_kw = cache_kwarg(self.model)
        self.share_prefill = share_prefill

    @torch.inference_mode()
    def generate(self, request: GenerationRequest) -> list[GeneratedCompletion]:
        g_size = request.group_size
        rows = 1 if self.share_prefill else g_size
        prompt = torch.tensor([request.prompt_ids] * rows, dtype=torch.long, device=self.device)
        out = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = getattr(out, self._cache_kw)
        if self.share_prefill:
            cache.batch_repeat_interleave(g_size)
        logits = out.logits[:, -1, :].float().expand(g_size, -1)  # (G, V)

        def step(nxt: torch.Tensor) -> torch.Tensor:
            out = self.model(input_ids=nxt[:, None], use_cache=True, **{self._cache_kw: cache})
            return out.logits[:, -1, :].float()

        return self._decode(logits, step, [request])[0]

    @torch.inference_mode()
    def generate_batch(
        self, requests: Sequence[GenerationRequest]
    ) -> list[list[GeneratedCompletion]]:
        """:meth:`generate` of several requests in one batched pass, in request order.

        The requests must agree on group size, sampling parameters, ``max_tokens``
        and stop tokens (:func:`batch_key`); prompts may differ in length (left
        padding). Each prompt is encoded once and its cache repeated G times.
        Every row samples with its own request's verifiable noise, so a token
        can differ from :meth:`generate`'s only where two candidates tie within
        float rounding of the padded batch (the validator accepts either).
        """
        if len(requests) == 1:
            return [self.generate(requests[0])]
        if not requests or len({batch_key(r) for r in requests}) != 1:
            raise ValueError("generate_batch needs one or more requests with one batch_key")
        g_size = requests[0].group_size
        copies = 1 if self.share_prefill else g_size  # prompt rows prefilled per request
        ids, mask, positions = (
            t.to(self.device)
            for t in left_padded([r.prompt_ids for r in requests for _ in range(copies)])
        )
        # Each prompt once; its cache, mask and logits then serve its G completions
        # (``share_prefill=False``: each completion's own row from the start).
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, self._cache_kw)
        repeat = g_size // copies
        if repeat > 1:
            cache.batch_repeat_interleave(repeat)
        state = {
            "mask": mask.repeat_interleave(repeat, dim=0),
            "next": positions[:, -1:].repeat_interleave(repeat, dim=0) + 1,
        }

        def step(nxt: torch.Tensor) -> torch.Tensor:
            state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], dim=1)
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=state["mask"],
                position_ids=state["next"],
                use_cache=True,
                **{self._cache_kw: cache},
            )
            state["next"] = state["next"] + 1
            return out.logits[:, -1, :].float()

        return self._decode(
            out.logits[:, -1, :].float().repeat_interleave(repeat, dim=0), step, requests
        )

    def _decode(
        self,
        logits: torch.Tensor,
        step: Callable[[torch.Tensor], torch.Tensor],
        requests: Sequence[GenerationRequest],
    ) -> list[list[GeneratedCompletion]]:
        """Sample every row to a stop token or ``max_tokens``; rows are the requests' G
        completions in order, ``logits`` the rows' first next-token logits, ``step(tokens)``
        feeds one token per row and returns the next logits."""
        first = requests[0]
        rows = [(r, g) for r in requests for g in range(r.group_size)]
        n = len(rows)
        stops = torch.tensor(
            sorted(set(first.stop_token_ids)), dtype=torch.long, device=self.device
        )
        tokens = torch.zeros((n, first.max_tokens), dtype=torch.long, device=self.device)
        chosen = torch.zeros((n, first.max_tokens), dtype=torch.float32, device=self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        lengths = torch.full((n,), first.max_tokens, dtype=torch.long)
        for t in range(first.max_tokens):
            lp = process_logits(logits, first.temperature, first.top_k, first.top_p)
            nxt = self._sample(lp, rows, t, done, first.temperature)  # (n,)
            nxt = torch.where(done, tokens[:, t - 1] if t else nxt, nxt)
            tokens[:, t] = nxt
            chosen[:, t] = lp.gather(-1, nxt[:, None])[:, 0]
            hit = torch.isin(nxt, stops) & ~done
            lengths[hit.cpu()] = t + 1
            done |= hit
            if bool(done.all()) or t + 1 == first.max_tokens:
                break
            logits = step(nxt)
        out: list[list[GeneratedCompletion]] = []
        for row, (r, g) in enumerate(rows):
            if g == 0:
                out.append([])
            out[-1].append(self._completion(g, tokens[row], chosen[row], int(lengths[row]), r))
        return out

    @staticmethod
    def _sample(
        lp: torch.Tensor,
        rows: list[tuple[GenerationRequest, int]],
        t: int,
        done: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        if temperature == 0.0:
            return lp.argmax(dim=-1)  # point mass: the noise cannot change the argmax
        live = [i for i in range(lp.shape[0]) if not bool(done[i])]
        out = torch.zeros(lp.shape[0], dtype=torch.long, device=lp.device)
        if live:  # finished rows are overwritten by the caller; they draw nothing
            sampler = sampler_named(rows[0][0].sampler)
            randomness = sampler.randomness(
                [(r.sampler_key, r.nonce, r.seed, g, [t]) for r, g in (rows[i] for i in live)],
                lp.shape[-1],
            )
            index = torch.tensor(live, dtype=torch.long, device=lp.device)
            out[index] = sampler.draw(lp.index_select(0, index), randomness).to(lp.device)
        return out

    @staticmethod
    def _completion(
        g: int, tokens: torch.Tensor, chosen: torch.Tensor, length: int, request: GenerationRequest
    ) -> GeneratedCompletion:
        ids = tuple(int(x) for x in tokens[:length].tolist())
        logprobs = chosen[:length].to("cpu", torch.float32).numpy().copy()
        logprobs.setflags(write=False)
        stopped = bool(ids) and ids[-1] in set(request.stop_token_ids)
        return GeneratedCompletion(g, ids, logprobs, "stop" if stopped else "length")


@register_backend("transformers-generate")
class GenerateBackend(TransformersBackend):
    """Plain ``transformers``: ``model.generate`` with its own KV cache, each of the G
    completions its own row (the prompt encoded G times), the keyed sampler applied as a
    logits processor that leaves only the drawn token. Other kernels, shapes and cache
    handling than :class:`TransformersBackend`'s shared-prompt path, so other rounding: the
    honest noise a calibration must also cover."""

    name = "transformers-generate"

    @torch.inference_mode()
    def generate(self, request: GenerationRequest) -> list[GeneratedCompletion]:
        from transformers import GenerationConfig, LogitsProcessorList

        g_size, start = request.group_size, len(request.prompt_ids)
        ids = torch.tensor([request.prompt_ids] * g_size, dtype=torch.long, device=self.device)
        draw = _KeyedDraw(request, start)
        stops = list(request.stop_token_ids)
        config = GenerationConfig(
            max_new_tokens=request.max_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
        )
        out = self.model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            logits_processor=LogitsProcessorList([draw]),
        )
        tokens = out[:, start:]
        chosen = torch.stack(draw.chosen, dim=1)  # (G, steps)
        completions = []
        for g in range(g_size):
            row = tokens[g].tolist()
            hits = [t for t, x in enumerate(row) if x in request.stop_token_ids]
            length = hits[0] + 1 if hits else len(row)
            completions.append(self._completion(g, tokens[g], chosen[g], length, request))
        return completions

    def generate_batch(
        self, requests: Sequence[GenerationRequest]
    ) -> list[list[GeneratedCompletion]]:
        return [self.generate(r) for r in requests]


class _KeyedDraw:
    """A logits processor: the request's keyed sample of the processed distribution at each
    step, every other token masked; records each drawn token's committed logprob."""

    def __init__(self, request: GenerationRequest, prompt_len: int) -> None:
        self.request, self.prompt_len = request, prompt_len
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        r = self.request
        t = input_ids.shape[1] - self.prompt_len
        lp = process_logits(scores.float(), r.temperature, r.top_k, r.top_p)
        if r.temperature == 0.0:
            nxt = lp.argmax(dim=-1)
        else:
            sampler = sampler_named(r.sampler)
            spec = [(r.sampler_key, r.nonce, r.seed, g, [t]) for g in range(lp.shape[0])]
            nxt = sampler.draw(lp, sampler.randomness(spec, lp.shape[-1])).to(lp.device)
        self.chosen.append(lp.gather(-1, nxt[:, None])[:, 0])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, nxt[:, None], 0.0)
