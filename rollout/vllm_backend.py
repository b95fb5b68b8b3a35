"""vLLM generation backend with the verifiable sampler (GPU; ``pip install 'prooftrain[vllm]'``).

It returns what :class:`rollout.backends.TransformersBackend` returns: token t
of completion g is the draw of the request's verifiable sampler
(``verify.samplers``; by default the inverse-CDF sample of
``process_logits(row)`` at ``icdf_uniform(key, nonce, seed, t,
sample_index=g)``) and its committed logprob is ``process_logits(row)[token]``,
both computed on the float32 logits row vLLM's model produced.

How vLLM is made to emit that token
-----------------------------------
A custom logits processor, :func:`processor_class`, runs inside vLLM's sampler
on every step. For each row of one of our requests it

1. processes the row with ``process_logits`` (temperature, top-k, top-p);
2. draws the named sampler's keyed randomness for (completion g, position t)
   and takes its token (one uniform per row for inverse-CDF, computed on the
   CPU; the draw itself runs on the row's device);
3. records ``(token, logprob)`` under the completion's tag;
4. overwrites the row with ``-inf`` everywhere but that token (``0.0``).

vLLM itself runs greedy (``temperature=0``), but a row with a single finite
entry yields that token under any of its sampling paths, so vLLM's sampler
settings cannot change a token. vLLM's own logprob outputs are not used. After
generation every emitted token is checked against the record for its position
(:func:`collect_logprobs`); a missing or different record raises
:class:`VllmSamplerError` instead of returning unverifiable completions.

The position t is ``len(output_token_ids)`` under the V1-runner interface and
``pos + 1 - prompt_len`` under the Model Runner V2 interface (``ctx.pos`` is
the position of the row's last input token).

vLLM API this targets
---------------------
* ``vllm.v1.sample.logits_processor.LogitsProcessor`` (V1 model runner, vLLM
  0.10.2 and later; ``AddedRequest = (index, params, prompt_ids, output_ids)``,
  older releases omit ``prompt_ids``), and
* ``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`` (Model Runner
  V2, the default runner since 0.25; this interface is the documented one in
  0.32 and later, earlier V2 releases adapt V1-interface processors).

The processor class derives from whichever of the two exists (both where both
do), so either runner loads it. Records travel through process memory, so the
engine runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
``uni`` executor (one GPU, no tensor parallelism, no speculative decoding).
Models load from a local directory only, with the Hub offline and usage stats off.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollout.backends import (
    GeneratedCompletion,
    GenerationRequest,
    register_backend,
    resolve_dtype,
)
from verify.errors import ConfigError, ProofTrainError
from verify.samplers import DEFAULT_SAMPLER, sampler_named
from verify.sampling import process_logits

EXTRA_ARGS_KEY = "prooftrain_sampler"
"""Key of the per-request sampler description in ``SamplingParams.extra_args``."""
_INSTALL_HINT = "the vllm backend needs vLLM: pip install 'prooftrain[vllm]'"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# tag -> {position: (token id, committed logprob)}, written by the processor.
_RECORDS: dict[str, dict[int, tuple[int, float]]] = {}


class VllmSamplerError(ProofTrainError):
    """vLLM emitted a token that the verifiable sampler did not choose."""


@dataclass(frozen=True)
class RowSpec:
    """What the processor needs to sample one completion; travels in ``extra_args``."""

    tag: str
    sampler_key: bytes
    nonce: bytes
    seed: int
    sample_index: int
    temperature: float
    top_k: int
    top_p: float
    prompt_len: int
    sampler: str = DEFAULT_SAMPLER

    def to_extra_args(self) -> dict[str, Any]:
        return {
            EXTRA_ARGS_KEY: {
                "tag": self.tag,
                "key": self.sampler_key.hex(),
                "nonce": self.nonce.hex(),
                "seed": self.seed,
                "g": self.sample_index,
                "temperature": self.temperature,
                "top_k": self.top_k,
                "top_p": self.top_p,
                "prompt_len": self.prompt_len,
                "sampler": self.sampler,
            }
        }

    @classmethod
    def from_extra_args(cls, extra: dict[str, Any] | None) -> RowSpec | None:
        """None for a request without a sampler entry; ``ValueError`` if it is malformed."""
        entry = (extra or {}).get(EXTRA_ARGS_KEY)
        if entry is None:
            return None
        try:
            return cls(
                str(entry["tag"]),
                bytes.fromhex(entry["key"]),
                bytes.fromhex(entry["nonce"]),
                int(entry["seed"]),
                int(entry["g"]),
                float(entry["temperature"]),
                int(entry["top_k"]),
                float(entry["top_p"]),
                int(entry["prompt_len"]),
                str(entry.get("sampler", DEFAULT_SAMPLER)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed {EXTRA_ARGS_KEY} entry: {exc}") from None


def force_verifiable_samples(
    logits: torch.Tensor,
    rows: Sequence[int],
    specs: Sequence[RowSpec],
    positions: Sequence[int],
) -> None:
    """Steps 1-4 of the module docstring on ``logits (B, V)`` in place.

    Rows sharing sampling parameters are processed as one batch. Afterwards
    row ``rows[i]`` has exactly one finite entry, its verifiable sample.
    """
    groups: dict[tuple[float, int, float, str], list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault((spec.temperature, spec.top_k, spec.top_p, spec.sampler), []).append(i)
    vocab = logits.shape[-1]
    for (temperature, top_k, top_p, name), members in groups.items():
        index = torch.tensor([rows[i] for i in members], dtype=torch.long, device=logits.device)
        lp = process_logits(logits.index_select(0, index), temperature, top_k, top_p)  # (R, V)
        if temperature == 0.0:  # greedy: a point mass, no randomness can move the argmax
            tokens = lp.argmax(dim=-1)
        else:
            sampler = sampler_named(name)
            randomness = sampler.randomness(
                [
                    (
                        specs[i].sampler_key,
                        specs[i].nonce,
                        specs[i].seed,
                        specs[i].sample_index,
                        [positions[i]],
                    )
                    for i in members
                ],
                vocab,
            )
            tokens = sampler.draw(lp, randomness).to(lp.device)  # (R,)
        chosen = lp.gather(-1, tokens[:, None])  # (R, 1)
        forced = torch.full_like(lp, float("-inf")).scatter_(-1, tokens[:, None], 0.0)
        logits.index_copy_(0, index, forced.to(logits.dtype))
        for i, token, logprob in zip(members, tokens.tolist(), chosen[:, 0].tolist(), strict=True):
            _RECORDS.setdefault(specs[i].tag, {})[positions[i]] = (int(token), float(logprob))


def collect_logprobs(tag: str, token_ids: Sequence[int]) -> np.ndarray:
    """Pop the records of one completion and return its committed float32 logprobs.

    Raises :class:`VllmSamplerError` unless every emitted token is the one the
    processor chose for its position.
    """
    records = _RECORDS.pop(tag, None)
    if records is None:
        raise VllmSamplerError(
            "no sampler records for a completion: vLLM ran its sampler outside this process "
            "(set VLLM_ENABLE_V1_MULTIPROCESSING=0 and use the 'uni' executor) or did not "
            "load the prooftrain logits processor"
        )
    out = np.empty(len(token_ids), dtype=np.float32)
    for t, token in enumerate(token_ids):
        record = records.get(t)
        if record is None or record[0] != int(token):
            raise VllmSamplerError(
                f"vLLM emitted token {int(token)} at position {t}, the verifiable sampler "
                f"chose {None if record is None else record[0]}"
            )
        out[t] = record[1]
    out.setflags(write=False)
    return out


def _stack_bases() -> tuple[type, ...]:
    bases: list[type] = []
    try:  # Model Runner V2 interface (vLLM >= 0.32)
        from vllm.v1.worker.gpu.sample.logits_processor.interface import (
            LogitsProcessor as V2Processor,
        )

        bases.append(V2Processor)
    except ImportError:
        pass
    try:  # V1 model runner interface (vLLM >= 0.10.2)
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1Processor

        bases.append(V1Processor)
    except ImportError:
        pass
    if not bases:
        raise ConfigError(
            "this vLLM has no custom logits processor interface; "
            "install a newer one: pip install 'prooftrain[vllm]'"
        )
    return tuple(bases)


@lru_cache(maxsize=1)
def processor_class() -> type:
    """The vLLM logits processor class (imports vLLM; cached)."""

    class VerifiableSamplerProcessor(*_stack_bases()):  # type: ignore[misc]
        """Forces every row of a prooftrain request to its verifiable sample.

        State maps a batch index (V1 runner) or a request slot (Model Runner V2)
        to ``(RowSpec, output token list or None)``.
        """

        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            self._state: dict[int, tuple[RowSpec, list[int] | None]] = {}

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            RowSpec.from_extra_args(getattr(sampling_params, "extra_args", None))

        def is_argmax_invariant(self) -> bool:
            return False  # it decides the argmax

        # V1 runner: persistent-batch bookkeeping; order is removed, added, moved.
        def update_state(self, batch_update: Any) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self._state.pop(index, None)
            for index, params, *rest in batch_update.added:
                spec = RowSpec.from_extra_args(getattr(params, "extra_args", None))
                if spec is None:
                    self._state.pop(index, None)
                else:
                    self._state[index] = (spec, rest[-1])  # live list of output tokens
            for a, b, direction in batch_update.moved:
                a_val, b_val = self._state.pop(a, None), self._state.pop(b, None)
                if a_val is not None:
                    self._state[b] = a_val
                if b_val is not None and direction.name == "SWAP":
                    self._state[a] = b_val

        # Model Runner V2: per-slot state, reset by every request entering the slot.
        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            spec = RowSpec.from_extra_args(getattr(sampling_params, "extra_args", None))
            if spec is None:
                self._state.pop(req_idx, None)
                return False
            self._state[req_idx] = (spec, None)
            return True

        def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
            if not self._state:
                return logits
            if ctx is None:  # V1 runner: row = batch index
                mine = [
                    (row, s[0], len(s[1] or ()))
                    for row, s in self._state.items()
                    if row < logits.shape[0]
                ]
            else:
                mine = self._v2_rows(logits, ctx)
            mine = [m for m in mine if m[2] >= 0]  # negative: a partial prefill chunk
            if mine:
                rows, specs, positions = zip(*mine, strict=True)
                force_verifiable_samples(logits, rows, specs, positions)
            return logits

        def _v2_rows(self, logits: torch.Tensor, ctx: Any) -> list[tuple[int, RowSpec, int]]:
            slots = [int(s) for s in ctx.idx_mapping_np]
            if logits.shape[0] != len(slots):
                raise VllmSamplerError(
                    "the verifiable sampler does not support speculative "
                    "decoding (several logits rows per request)"
                )
            ours = [
                (row, self._state[slot][0]) for row, slot in enumerate(slots) if slot in self._state
            ]
            if not ours:
                return []
            pos = ctx.pos.tolist()  # (rows,) position of each row's last input token
            return [(row, spec, int(pos[row]) + 1 - spec.prompt_len) for row, spec in ours]

    return VerifiableSamplerProcessor


def _import_vllm() -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # records live in this process
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        os.environ.setdefault(name, "1")
    try:
        import vllm
    except ImportError:
        raise ConfigError(_INSTALL_HINT) from None
    return vllm


@register_backend("vllm")
class VllmBackend:
    """Generation with a vLLM engine (one GPU) and the verifiable sampler.

    ``model`` is a local model directory (``config.json`` and safetensors; no
    tokenizer needed, prompts are token ids). ``engine_kwargs`` go to
    ``vllm.LLM`` unchanged (e.g. ``max_num_seqs``, ``enable_prefix_caching``).
    """

    name = "vllm"

    loads_from_directory = True
    """A policy version rebuilt in memory is written to a directory first."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: torch.dtype | str | None = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        device: str | torch.device = "cuda",
        **engine_kwargs: Any,
    ) -> None:
        if torch.device(device).type != "cuda":
            raise ConfigError(
                f"the vllm backend runs on a CUDA GPU, not {device!r} "
                "(use the transformers backend on a CPU)"
            )
        path = Path(model)
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise ConfigError(
                f"vllm backend: {path} is not a local model directory "
                "(no config.json); models are never downloaded"
            )
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        resolved = resolve_dtype(dtype)
        vllm = _import_vllm()
        self.model_path = path
        self.dtype = "auto" if resolved is None else _DTYPE_NAMES[resolved]
        self.precision = "bfloat16" if self.dtype == "auto" else self.dtype
        """The generation precision the contributor declares in its headers."""
        self.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        self._vllm = vllm
        self._llm = vllm.LLM(
            model=str(path),
            skip_tokenizer_init=True,
            dtype=self.dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            tensor_parallel_size=1,
            distributed_executor_backend="uni",
            logits_processors=[processor_class()],
            **engine_kwargs,
        )

    def generate(self, request: GenerationRequest) -> list[GeneratedCompletion]:
        return self.generate_many([request])[0]

    def generate_many(
        self, requests: Sequence[GenerationRequest]
    ) -> list[list[GeneratedCompletion]]:
        """Several assignments in one engine call (continuous batching); input order kept."""
        prompts, params, tags = [], [], []
        for request in requests:
            for g in range(request.group_size):
                spec = RowSpec(
                    uuid.uuid4().hex,
                    request.sampler_key,
                    request.nonce,
                    request.seed,
                    g,
                    request.temperature,
                    request.top_k,
                    request.top_p,
                    len(request.prompt_ids),
                    request.sampler,
                )
                prompts.append({"prompt_token_ids": list(request.prompt_ids)})
                params.append(self._sampling_params(request, spec))
                tags.append(spec.tag)
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
            if len(outputs) != len(tags):
                raise VllmSamplerError(f"vLLM returned {len(outputs)} outputs for {len(tags)}")
            result, start = [], 0
            for request in requests:
                result.append(
                    [
                        self._completion(g, outputs[start + g], tags[start + g], request)
                        for g in range(request.group_size)
                    ]
                )
                start += request.group_size
            return result
        finally:
            for tag in tags:
                _RECORDS.pop(tag, None)

    def _sampling_params(self, request: GenerationRequest, spec: RowSpec) -> Any:
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=request.max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=True,
            detokenize=False,
            extra_args=spec.to_extra_args(),
        )

    @staticmethod
    def _completion(
        g: int, output: Any, tag: str, request: GenerationRequest
    ) -> GeneratedCompletion:
        ids = tuple(int(x) for x in output.outputs[0].token_ids)
        logprobs = collect_logprobs(tag, ids)
        stops = set(request.stop_token_ids)
        if not ids or len(ids) > request.max_tokens or any(x in stops for x in ids[:-1]):
            raise VllmSamplerError(
                f"vLLM returned {len(ids)} tokens for completion {g} "
                f"(max_tokens {request.max_tokens}, stop tokens {stops})"
            )
        stopped = ids[-1] in stops
        return GeneratedCompletion(g, ids, logprobs, "stop" if stopped else "length")

    def close(self) -> None:
        """Release the engine and its GPU memory (the object is unusable afterwards)."""
        llm = self.__dict__.pop("_llm", None)
        engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        del llm
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )
        except ImportError:
            pass
        else:
            destroy_model_parallel()
            destroy_distributed_environment()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> VllmBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
