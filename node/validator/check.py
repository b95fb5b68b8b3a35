"""``prooftrain validator --check``: load every setting and file a node would use, read-only.

``describe`` opens the ledger read-only and touches nothing else on disk: no
ledger entry, no checkpoint, no state database, no blob directory is created
or changed, so a check can be run against a live node's files at any time.
Each line it returns names one input and where it came from, so an operator
can confirm the node read what they meant (the tolerance file, the trainer
key) before starting it.
"""

from __future__ import annotations

import re
from pathlib import Path

from ledger.records import LogCreated, PolicyPublished, decode_record
from ledger.storage import open_store, storage_errors
from node.config import ValidatorConfig
from node.validator.build import load_key, load_problems, load_tolerance, trainer_key
from verify.errors import ConfigError
from verify.keys import SigningKey


def redact(url: str) -> str:
    """A ledger URL fit to print: a PostgreSQL DSN's password replaced by ``***``."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def describe(cfg: ValidatorConfig, key: SigningKey | None = None) -> list[str]:
    """One line per input the node uses, after loading and checking each (``ConfigError`` if any
    is missing or wrong). Changes nothing on disk."""
    key = key or load_key(cfg.node.key_file)
    model_dir = cfg.policy.model_dir
    if not (Path(model_dir) / "config.json").exists():
        raise ConfigError(
            f"policy.model_dir {model_dir} is not a model directory; build one with "
            "`prooftrain base-model build`"
        )
    size, version = _ledger_summary(cfg, key)
    tolerances = load_tolerance(cfg)
    bounds = ", ".join(
        f"{p}: token {t.token_abs:g}, chunk mean {t.chunk_mean_abs:g}, slack {t.cdf_slack:g}"
        + (
            f", divergence nulls {t.divergence.logprob_null:g}/{t.divergence.replay_null:g} "
            f"(false alarm <= {t.divergence.false_alarm:g} in {t.divergence.horizon_tokens:,} "
            "audited tokens)"
            if t.divergence
            else ""
        )
        for p, t in sorted(tolerances.by_precision.items())
    )
    trainer = trainer_key(cfg)
    problems = load_problems(cfg)
    a = cfg.assignment
    return [
        f"validator key {key.public.hex()} ({cfg.node.key_file})",
        f"ledger        {redact(cfg.node.ledger)} "
        + (
            f"({size} entries)"
            if size is not None
            else "(not created yet: the first start creates it)"
        ),
        f"state file    {cfg.node.state_path()}",
        f"blob store    {cfg.node.blob_path()}",
        f"policy        {model_dir} (version {version}, recomputed in {cfg.policy.dtype}, "
        f"max_staleness {cfg.rules.max_staleness})",
        f"task          {cfg.task.jsonl or cfg.task.name} ({len(problems)} problems)",
        f"sampling      group_size {a.group_size}, temperature {a.temperature:g}, top_p {a.top_p:g}, "
        f"top_k {a.top_k}, max_tokens {a.max_tokens}",
        f"tolerance     {cfg.audit.tolerance_file or 'built-in'} ({bounds})",
        "trainer key   "
        + (
            f"{trainer.hex()} ({cfg.node.trainer_key})"
            if trainer is not None
            else "none: /v1/samples, /v1/policy and /v1/blobs uploads are disabled"
        ),
        f"admission     {cfg.node.admission_threads} thread(s), "
        f"{cfg.node.admission_processes or 'no'} precheck process(es)",
    ]


def _ledger_summary(cfg: ValidatorConfig, key: SigningKey) -> tuple[int | None, int]:
    """(entries, newest policy version) of the ledger, read-only; (None, 0) if it does not exist yet."""
    if not cfg.node.is_postgres() and not Path(cfg.node.ledger.removeprefix("sqlite:")).exists():
        return None, 0
    store = open_store(cfg.node.ledger, readonly=True)
    try:
        try:
            first = store.entry(0)
        except storage_errors():  # a PostgreSQL database the node has not initialised yet
            return None, 0
        if first is None:
            return None, 0
        genesis = decode_record(first[1])
        if isinstance(genesis, LogCreated) and genesis.log_key != key.public.raw:
            raise ConfigError(
                f"node.key_file {cfg.node.key_file} is not the key of the ledger "
                f"{redact(cfg.node.ledger)} (its log key is {genesis.log_key.hex()})"
            )
        version = 0
        for _, _, data in store.entries():
            rec = decode_record(data)
            if isinstance(rec, PolicyPublished):
                version = max(version, rec.version)
        return store.size(), version
    finally:
        store.close()
