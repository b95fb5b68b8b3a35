"""Issue 37, finding 2: a remote trainer reads what the validator fixes, refuses a remaining
mismatch by name, and says what it waits for."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.buffer import Taken
from trainer.config import TrainerConfig
from trainer.remote_network import adopt_network, check_base_model, waiting_reporter
from verify.errors import ConfigError

INFO = {
    "network": {
        "task": "arithmetic",
        "rules": {"max_staleness": 2, "audit_rate": -1.0},
        "temperature": 1.0,
        "group_size": 4,
        "max_tokens": 16,
        "base_model_digest": "ab" * 32,
    }
}


def test_sampling_settings_come_from_the_validator() -> None:
    cfg = TrainerConfig.model_validate({"local": {"temperature": 0.5}})  # as configs/trainer.toml
    got = adopt_network(cfg, INFO, "http://v")
    assert (
        got.local.temperature == 1.0 and got.rules.max_staleness == 2 and got.task == "arithmetic"
    )


def test_an_explicit_mismatch_names_both_values_and_the_setting() -> None:
    cfg = TrainerConfig.model_validate({"rules": {"max_staleness": 8}})
    with pytest.raises(ConfigError) as err:
        adopt_network(cfg, INFO, "http://v")
    text = str(err.value)
    assert "trainer rules.max_staleness = 8" in text and "has rules.max_staleness = 2" in text


def test_another_base_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--model"):
        check_base_model(tmp_path, b"\xcd" * 32, INFO, "http://v")
    check_base_model(tmp_path, b"\xab" * 32, INFO, "http://v")


def test_the_waiting_trainer_says_what_it_waits_for() -> None:
    class Buffer:
        filling = Taken(groups=[[], []], stale_dropped=3, uniform_dropped=8)

        def __len__(self) -> int:
            return 5

    lines: list[str] = []
    wait = waiting_reporter(
        Buffer(),
        TrainerConfig.model_validate({"batch_groups": 32}),
        poll_s=0.0,
        every_s=0.0,
        log=lines.append,
    )
    wait()
    assert lines and "2/32 usable groups" in lines[0]
    assert (
        "8 rollouts in groups whose rewards were all equal" in lines[0]
        and "3 rollouts older" in lines[0]
    )
