"""What a remote trainer takes from its validator, and what it says while it waits for samples.

The validator fixes the network's settings (``/v1/info`` ``network``): the task,
the staleness bound, the sampling temperature its assignments carry, the base
model. A remote trainer reads them instead of repeating them:

- ``[trainer.local]`` describes the in-process network only; in remote mode the
  rollouts' temperature (which the trainer scores at) is the validator's;
- ``task`` and the network's shared settings (``rules``: the staleness bound,
  the audit rate) are taken from the validator unless the trainer's config sets
  them explicitly to something else, which is refused at start, naming both
  values and the setting;
- the base model the trainer loads must be the validator's (same digest).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config import TrainerConfig
from trainer.network_rules import NetworkRules
from verify.errors import ConfigError


def adopt_network(cfg: TrainerConfig, info: dict[str, Any], url: str) -> TrainerConfig:
    """``cfg`` with the validator's network settings; ``ConfigError`` on an explicit mismatch."""
    net = info.get("network")
    if not net:
        raise ConfigError(
            f"the validator at {url} does not publish its network settings "
            "(/v1/info has no 'network'); upgrade it"
        )
    rules = NetworkRules.model_validate(net["rules"])
    explicit = (
        [("task", cfg.task, "task.name", net["task"])] if "task" in cfg.model_fields_set else []
    )
    explicit += [
        (f"rules.{name}", getattr(cfg.rules, name), f"rules.{name}", getattr(rules, name))
        for name in sorted(cfg.rules.model_fields_set)
    ]
    for name, ours, setting, theirs in explicit:
        if ours != theirs:
            raise ConfigError(
                f"trainer {name} = {ours!r} but the validator at {url} has {setting} = {theirs!r}; "
                f"remove {name} from the trainer config (it is read from the validator) or change "
                f"the validator's {setting}"
            )
    local = cfg.local.model_copy(
        update={
            "temperature": float(net["temperature"]),
            "group_size": max(2, int(net["group_size"])),
            "max_tokens": int(net["max_tokens"]),
        }
    )
    return cfg.model_copy(update={"task": net["task"], "rules": rules, "local": local})


def check_base_model(model_dir: Path, digest: bytes, info: dict[str, Any], url: str) -> None:
    """Refuse a base model other than the validator's: its versions would not apply."""
    theirs = info["network"]["base_model_digest"]
    if digest.hex() != theirs:
        raise ConfigError(
            f"the trainer's base model {model_dir} (digest {digest.hex()[:16]}...) is not the "
            f"validator's (policy.model_dir, digest {theirs[:16]}...); pass the same directory "
            "with --model"
        )


def describe(cfg: TrainerConfig, model_dir: Path) -> str:
    return (
        f"from the validator: task {cfg.task}, max_staleness {cfg.rules.max_staleness}, "
        f"temperature {cfg.local.temperature:g}; base model {model_dir}; "
        f"{cfg.batch_groups} usable groups per step"
    )


def waiting_reporter(
    buffer: Any,
    cfg: TrainerConfig,
    poll_s: float,
    every_s: float = 5.0,
    log: Callable[[str], None] | None = None,
) -> Callable[[], None]:
    """A ``wait`` for ``TrainerLoop``: sleeps ``poll_s``, and every ``every_s`` seconds says what
    the trainer waits for (``SampleBuffer.filling``: usable groups so far for this step) and what
    was dropped since start (``SampleBuffer.*_dropped_total``, across every step)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    last = [time.monotonic()]

    def wait() -> None:
        now = time.monotonic()
        got = getattr(buffer, "filling", None)
        if got is not None and now - last[0] >= every_s:
            last[0] = now
            log(
                f"waiting for samples: {len(got.groups)}/{cfg.batch_groups} usable groups for this "
                f"step (batch_groups); dropped since start: {buffer.uniform_dropped_total} rollouts in "
                "groups whose rewards were all equal (skip_uniform_groups), "
                f"{buffer.stale_dropped_total} rollouts older "
                f"than max_staleness = {cfg.rules.max_staleness}; {len(buffer)} rollouts held in incomplete "
                "groups"
            )
        time.sleep(poll_s)

    return wait
