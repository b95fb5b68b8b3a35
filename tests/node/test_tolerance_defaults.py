"""What a node admits without a calibration file: float32 rollouts under the built-in bound only."""

from __future__ import annotations

import pytest

from node.config import ValidatorConfig, load
from node.validator.build import load_tolerance
from verify.errors import ConfigError, Reason, VerificationError
from verify.spotcheck import FLOAT32_TOLERANCE


def test_without_a_tolerance_file_only_float32_is_admitted() -> None:
    tol = load_tolerance(load(ValidatorConfig, None, {}))
    assert tol.of("float32") == FLOAT32_TOLERANCE
    with pytest.raises(VerificationError) as exc:
        tol.of("bfloat16")  # refused as unsupported (not slashed), never judged on a guessed bound
    assert exc.value.reason is Reason.UNSUPPORTED_PRECISION


def test_a_bfloat16_recomputation_without_a_calibration_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="needs audit.tolerance_file"):
        load_tolerance(load(ValidatorConfig, None, {"policy.dtype": "bfloat16"}))
