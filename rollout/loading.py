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
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MODEL_BUILD_LOCK", "load_pretrained_lm"]

MODEL_BUILD_LOCK = threading.RLock()
"""Held while ``transformers`` builds (``from_config``) or loads (``from_pretrained``) a model."""


def load_pretrained_lm(path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` under :data:`MODEL_BUILD_LOCK`."""
    from transformers import AutoModelForCausalLM

    with MODEL_BUILD_LOCK:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
