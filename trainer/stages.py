"""Pipeline stages of a decoder-only causal LM, built without the full weights.

A Llama-architecture model (``model.embed_tokens``, ``model.layers``,
``model.norm``, ``lm_head`` and a rotary embedding; Llama, Mistral, Qwen2 and
their relatives) is cut into S contiguous groups of decoder blocks:

    stage 0      embed_tokens, layers[r_0]
    stage s      layers[r_s]
    stage S-1    layers[r_{S-1}], norm, lm_head

Invariants:
- A :class:`Stage`'s parameter names are exactly the Hugging Face names of the
  tensors it owns (``model.layers.5.mlp.up_proj.weight``), so a stage's
  ``state_dict()`` is a slice of the full model's and the union over stages is
  the whole model. No stage holds a tensor of another stage.
- :func:`load_stage` reads only its own stage's tensors from the safetensors
  file(s); the remaining modules are built on the ``meta`` device and never
  allocated. ``Stage.loaded_keys`` records which file keys were read.
- Tied embeddings (``tie_word_embeddings``): with S = 1 the stage ties
  ``lm_head.weight`` to ``model.embed_tokens.weight`` exactly as Hugging Face
  does. With S > 1 the last stage holds its own *copy* of the embedding matrix
  as ``lm_head.weight`` (listed in ``Stage.tied_copies``); the runner sums the
  two gradients between the first and last stage before each optimizer step,
  so both copies receive the same update and stay bit-identical. The copy is
  not an independent parameter: a checkpoint of the model takes
  ``model.embed_tokens.weight`` from stage 0.
- :func:`save_stage` writes only the stage's own tensors; with
  :func:`write_index` the shards form a standard sharded safetensors
  checkpoint that reloads with any stage count (checkpoint and resume).
- Stage 0 consumes ``input_ids`` (B, T); every other stage consumes hidden
  states (B, T, H). The last stage returns logits (B, T, V), or (B, K, V) at the K
  positions per row a training step keeps (``Stage.forward``'s ``keep``); every other stage
  returns hidden states (B, T, H).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from rollout.loading import MODEL_BUILD_LOCK
from rollout.sync import StageSpec, partition_layers
from verify.errors import ConfigError

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_MASKS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


class _Body(nn.Module):
    """Holds ``embed_tokens``/``layers``/``norm`` under the Hugging Face names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens: nn.Module | None = None
        # Keys are the global layer indices, so names match ``model.layers.{i}``.
        self.layers = nn.ModuleDict()
        self.norm: nn.Module | None = None


class Stage(nn.Module):
    """One pipeline stage: a contiguous slice of a causal LM. See module docstring."""

    def __init__(
        self,
        config: PretrainedConfig,
        spec: StageSpec,
        *,
        embed_tokens: nn.Module | None,
        layers: Mapping[int, nn.Module],
        norm: nn.Module | None,
        lm_head: nn.Module | None,
        rotary_emb: nn.Module,
    ) -> None:
        super().__init__()
        if spec.is_first != (embed_tokens is not None):
            raise ConfigError("embed_tokens must be given to the first stage and only to it")
        if spec.is_last != (norm is not None and lm_head is not None):
            raise ConfigError("norm and lm_head must be given to the last stage and only to it")
        if sorted(layers) != list(spec.layers):
            raise ConfigError(f"stage {spec.index} expects layers {list(spec.layers)}")
        self.config = config
        self.spec = spec
        self.model = _Body()
        self.model.embed_tokens = embed_tokens
        for i in spec.layers:
            self.model.layers[str(i)] = layers[i]
        self.model.norm = norm
        self.lm_head = lm_head
        # No parameters; rebuilt from the config on every stage.
        self.rotary_emb = rotary_emb
        self.attention_types = {i: _attention_type(config, i) for i in spec.layers}
        self.tied_copies: dict[str, str] = {}
        self.loaded_keys: frozenset[str] = frozenset()
        if _tied(config) and spec.is_first and spec.is_last:
            assert lm_head is not None and embed_tokens is not None
            lm_head.weight = embed_tokens.weight
        elif _tied(config) and spec.is_last:
            self.tied_copies = {LM_HEAD_KEY: EMBED_KEY}

    @property
    def owns_tied_embedding(self) -> bool:
        """True on the first and the last stage of a tied, multi-stage model."""
        return (
            _tied(self.config)
            and self.spec.num_stages > 1
            and (self.spec.is_first or self.spec.is_last)
        )

    def tied_parameter(self) -> nn.Parameter:
        """This stage's copy of the tied embedding matrix (V, H)."""
        if not self.owns_tied_embedding:
            raise ConfigError(f"stage {self.spec.index} holds no tied embedding copy")
        module = self.model.embed_tokens if self.spec.is_first else self.lm_head
        assert module is not None
        weight = module.weight
        assert isinstance(weight, nn.Parameter)
        return weight

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x``: input_ids (B, T) on the first stage, hidden (B, T, H) elsewhere.

        ``keep`` (B, K) positions: the last stage applies norm and head only there and
        returns (B, K, V) logits (norm and head act per position, so these equal the
        full logits at ``keep``); no (B, T, V) tensor is formed.
        """
        if self.spec.is_first:
            assert self.model.embed_tokens is not None
            hidden = self.model.embed_tokens(x)  # (B, T, H)
        else:
            hidden = x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = {
            kind: _MASKS[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                cache=None,
                position_ids=position_ids,
            )
            for kind in set(self.attention_types.values())
        }
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for key, layer in self.model.layers.items():
            hidden = layer(
                hidden,
                attention_mask=masks[self.attention_types[int(key)]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if not self.spec.is_last:
            return hidden
        assert self.model.norm is not None and self.lm_head is not None
        if keep is not None:
            index = keep.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (B, K, H)
            hidden = hidden.gather(1, index)  # (B, K, H)
        return self.lm_head(self.model.norm(hidden))  # (B, T or K, V)


def _attention_type(config: PretrainedConfig, layer: int) -> str:
    """Full or sliding-window causal attention, as the Hugging Face model decides it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kind = layer_types[layer]
    elif getattr(config, "sliding_window", None) is not None:
        kind = "sliding_attention"
    else:
        kind = "full_attention"
    if kind not in _MASKS:
        raise ConfigError(f"layer {layer} has unsupported attention type {kind!r}")
    return kind


def _tied(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _stage_from_modules(full: PreTrainedModel, spec: StageSpec, *, copy_modules: bool) -> Stage:
    take = copy.deepcopy if copy_modules else (lambda m: m)
    body = full.model
    lm_head = None
    if spec.is_last:
        lm_head = take(full.get_output_embeddings())
        if _tied(full.config) and not spec.is_first:
            # The last stage's own copy, so the first stage's tensor is never shared.
            lm_head.weight = nn.Parameter(lm_head.weight.detach().clone())
    return Stage(
        full.config,
        spec,
        embed_tokens=take(body.embed_tokens) if spec.is_first else None,
        layers={i: take(body.layers[i]) for i in spec.layers},
        norm=take(body.norm) if spec.is_last else None,
        lm_head=lm_head,
        rotary_emb=type(body.rotary_emb)(config=full.config),
    )


def split_model(model: PreTrainedModel, num_stages: int) -> list[Stage]:
    """Cut an in-memory model into stages (deep copies; ``model`` is left intact).

    For tests and single-host tools; a sharded job uses :func:`load_stage`.
    """
    specs = partition_layers(model.config.num_hidden_layers, num_stages)
    return [_stage_from_modules(model, spec, copy_modules=True) for spec in specs]


def checkpoint_keys(stage: Stage) -> dict[str, str]:
    """Map the stage's parameter names to the checkpoint keys they are read from."""
    return {name: stage.tied_copies.get(name, name) for name, _ in stage.named_parameters()}


def _key_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: model_dir / name for key, name in weight_map.items()}
    single = model_dir / _SINGLE_FILE
    if not single.is_file():
        raise ConfigError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_tensors(
    model_dir: Path, keys: list[str], *, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Read exactly ``keys`` from the safetensors file(s) in ``model_dir``."""
    files = _key_files(model_dir)
    missing = [k for k in keys if k not in files]
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks {missing[:5]}")
    out: dict[str, torch.Tensor] = {}
    for path in sorted(set(files[k] for k in keys)):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in keys:
                if files[key] == path:
                    out[key] = f.get_tensor(key).to(dtype)
    return out


def load_stage(
    model_dir: str | Path,
    stage_index: int,
    num_stages: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Stage:
    """Build stage ``stage_index`` of ``num_stages`` from a local model directory.

    Only this stage's tensors are read; every other module stays on ``meta``.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    specs = partition_layers(config.num_hidden_layers, num_stages)
    if not 0 <= stage_index < num_stages:
        raise ConfigError(f"stage index {stage_index} out of range for {num_stages} stages")
    spec = specs[stage_index]
    with MODEL_BUILD_LOCK, torch.device("meta"):
        full = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(full.model, name):
            raise ConfigError(f"{type(full).__name__} has no model.{name}; not a supported layout")
    stage = _stage_from_modules(full, spec, copy_modules=False)
    del full
    stage.rotary_emb.to(device)
    key_of = checkpoint_keys(stage)
    tensors = read_tensors(model_dir, sorted(set(key_of.values())), device=device, dtype=dtype)
    stage.load_state_dict(
        {name: tensors[key] for name, key in key_of.items()}, strict=False, assign=True
    )
    if spec.is_first and spec.is_last and _tied(config):
        # ``assign`` replaced the embedding Parameter; restore the Hugging Face tie.
        assert stage.lm_head is not None and stage.model.embed_tokens is not None
        stage.lm_head.weight = stage.model.embed_tokens.weight
    leftover = [n for n, p in stage.named_parameters() if p.is_meta]
    leftover += [n for n, b in stage.named_buffers() if b.is_meta]
    if leftover:
        raise ConfigError(
            f"stage {stage_index} has tensors the checkpoint did not supply: {leftover}"
        )
    stage.loaded_keys = frozenset(tensors)
    return stage


def shard_file_name(index: int, num_stages: int) -> str:
    """The file stage ``index`` of ``num_stages`` writes, in Hugging Face's sharded naming."""
    return f"model-{index + 1:05d}-of-{num_stages:05d}.safetensors"


def save_stage(stage: Stage, out_dir: str | Path) -> Path:
    """Write this stage's own tensors (tied copies excluded) as one safetensors shard.

    Every rank calls this; rank 0 also calls :func:`write_index`. Once all ranks
    have returned (a barrier), ``out_dir`` is a sharded Hugging Face checkpoint:
    :func:`load_stage` reads it for any stage count and ``from_pretrained`` for
    the whole model. The shard is written to a temporary name, then renamed.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().contiguous().cpu()
        for name, p in stage.named_parameters()
        if name not in stage.tied_copies
    }
    path = out_dir / shard_file_name(stage.spec.index, stage.spec.num_stages)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


def write_index(
    config: PretrainedConfig,
    out_dir: str | Path,
    num_stages: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``config.json`` and the shard index for a checkpoint saved by :func:`save_stage`.

    Needs no weights: the key layout comes from a ``meta`` model.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with MODEL_BUILD_LOCK, torch.device("meta"):
        full = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weight_map: dict[str, str] = {}
    total = 0
    for spec in partition_layers(config.num_hidden_layers, num_stages):
        stage = _stage_from_modules(full, spec, copy_modules=False)
        for name, p in stage.named_parameters():
            if name not in stage.tied_copies:
                weight_map[name] = shard_file_name(spec.index, num_stages)
                total += p.numel() * p.element_size()
    config.save_pretrained(out_dir)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    path = out_dir / _INDEX_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    tmp.replace(path)
    return path
