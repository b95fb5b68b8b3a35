"""``prooftrain base-model build``: train and cache the demo base policy."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

from pydantic import ValidationError

from verify.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "base-model",
        help="build the small demo base policy",
        description="Build the small base policy the demo post-trains.",
    )
    group.set_defaults(_parser=group)
    sub = group.add_subparsers(dest="base_model_command", metavar="COMMAND")
    p = sub.add_parser(
        "build",
        help="train a tiny Llama on a synthetic task until weak but not hopeless",
        description="Train a character-level Llama on seeded train-split problems, stop at the "
        "target dev accuracy, and save it with save_pretrained (safetensors + tokenizer). "
        "Deterministic for a seed; reuses the cache unless --force.",
    )
    p.add_argument("--task", default="arithmetic", help="synthetic task (default: arithmetic)")
    p.add_argument("--seed", type=int, default=0, help="build seed (default: 0)")
    p.add_argument("--out", help="output directory (default: the cache directory)")
    p.add_argument("--cache-dir", help="cache root (default: ~/.cache/prooftrain/base-models)")
    p.add_argument(
        "--config", help="TOML file with [base_model] settings (e.g. configs/base_model.toml)"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    p.add_argument("--json", action="store_true", help="print the build record as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_build)


def load_config(path: str | None, task: str):  # noqa: ANN201
    from trainer.base_model import BaseModelConfig  # noqa: PLC0415

    values: dict = {}
    if path is not None:
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        values = doc.get("base_model", {})
        extra = set(doc) - {"base_model"}
        if extra:
            raise ConfigError(f"{path}: unknown sections {sorted(extra)}")
    values["task"] = task
    try:
        return BaseModelConfig(**values)
    except ValidationError as exc:
        raise ConfigError(f"invalid base-model config: {exc}") from exc


def run_build(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    from trainer.base_model import (  # noqa: PLC0415
        BUILD_INFO,
        build_base_model,
        cache_path,
        weights_digest,
    )

    hf_logging.disable_progress_bar()  # keep the output to our own table and bar
    config = load_config(args.config, args.task)
    out = Path(args.out) if args.out else cache_path(config, args.seed, args.cache_dir)
    if (out / BUILD_INFO).is_file() and not args.force:
        info = json.loads((out / BUILD_INFO).read_text())
        if info.get("config_digest") != config.digest() or info.get("seed") != args.seed:
            raise ConfigError(f"{out} holds a different build; pass --force to replace it")
        cached = True
    else:
        build_base_model(config, args.seed, out, progress=not args.quiet)
        info = json.loads((out / BUILD_INFO).read_text())
        cached = False
    info["path"] = str(out)
    info["cached"] = cached
    # Computed, not read from build.json: a build cached by an older version recorded another digest.
    info["weights_digest"] = weights_digest(out)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print(f"base model: {out}{' (cached)' if cached else ''}")
        print(f"base digest: {info['weights_digest']} (as manifests and release cards name it)")
        print(
            f"parameters: {info['parameters']:,}  steps: {info['steps']}  "
            f"dev pass@1: {info['dev_accuracy']:.3f}  build time: {info['seconds']:.1f}s"
        )
    return 0
