"""Issue 37, finding 2: a remote trainer reads what the validator fixes, refuses a remaining
mismatch by name, and says what it waits for."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.test_loop import ListSource, groups_of
from tests.trainer.test_rl import group
from trainer.buffer import SampleBuffer, Taken
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
        filling = Taken(groups=[[], []])
        stale_dropped_total, uniform_dropped_total = 3, 8

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


class _Stop(Exception):
    pass


def test_the_dropped_counts_cover_every_fill_since_start() -> None:
    """Issue 48 item 9: the second fill's wait reports the drops of both fills, not its own."""

    def stale_and_uniform(start: int) -> list:
        uniform = group(bytes([0xF0 + start]) * 16, [0.0] * 4, version=3)
        return groups_of(1, version=0, start=start) + list(uniform)

    # one page per fill: the first takes the usable group 1, the second only drops
    samples = stale_and_uniform(0) + groups_of(1, version=3, start=1) + stale_and_uniform(2)
    buf = SampleBuffer(ListSource(samples), max_staleness=2, page=12)
    first = buf.fill(1, 4, wait=lambda: None, timeout_s=1)
    assert len(first.groups) == 1 and (first.stale_dropped, first.uniform_dropped) == (4, 4)

    lines: list[str] = []
    report = waiting_reporter(
        buf,
        TrainerConfig.model_validate({"batch_groups": 1}),
        poll_s=0.0,
        every_s=0.0,
        log=lines.append,
    )

    def wait() -> None:
        report()
        raise _Stop

    with pytest.raises(_Stop):
        buf.fill(1, 4, wait=wait, timeout_s=5)
    assert (buf.stale_dropped_total, buf.uniform_dropped_total) == (8, 8)
    assert "0/1 usable groups" in lines[0] and "dropped since start" in lines[0]
    assert "8 rollouts in groups whose rewards were all equal" in lines[0]
    assert "8 rollouts older than max_staleness" in lines[0]
