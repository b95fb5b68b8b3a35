"""``prooftrain validator --check``: load every setting and file a node would use, read-only.

``describe`` opens the ledger read-only and touches nothing else on disk: no
ledger entry, no checkpoint, no state database, no blob directory is created
or changed, so a check can be run against a live node's files at any time.
Every file the node reads must be readable, and every one it writes writable
(``check_paths``). It verifies the ledger as a start does (``ledger.start_check``): from the last
verified checkpoint, or with ``full`` the whole log. That checkpoint's signed
note is kept in ``<state_file>.verified``, the node's own file (each validator
sharing a PostgreSQL log has its own); only a start's check writes it, never
the node while it serves, so what a node appended in one run is verified at its
next start. The note is checked again under the log key before it is trusted,
so the file can move the start of the default pass only to a checkpoint the log
signed; ``full`` ignores it.
Each line it returns names one input and where it came from, so an operator
can confirm the node read what they meant (the tolerance file, the trainer
key) before starting it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ledger.blobs import write_atomically
from ledger.note import Verifier
from ledger.records import LogCreated, PolicyPublished, decode_record
from ledger.start_check import LedgerCheckError, Verified, verify_full, verify_since
from ledger.storage import open_store, storage_errors
from node.config import ValidatorConfig
from node.validator.build import load_key, load_problems, load_tolerance, trainer_key
from rollout.loading import local_model_dir
from verify.errors import ConfigError, LedgerError, VerificationError
from verify.keys import SigningKey

MODES = ("since-checkpoint", "full")
"""``--verify-ledger``: from the last verified checkpoint (default), or the whole log."""


def redact(url: str) -> str:
    """A ledger URL fit to print: a PostgreSQL DSN's password replaced by ``***``."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def describe(
    cfg: ValidatorConfig,
    key: SigningKey | None = None,
    *,
    verify: str = MODES[0],
    record: bool = False,
) -> list[str]:
    """One line per input the node uses, after loading and checking each (``ConfigError`` if any
    is missing or wrong, ``LedgerError`` if the ledger fails ``check_ledger`` with ``verify``).
    Changes nothing on disk, unless ``record`` keeps the checkpoint the check verified."""
    check_paths(cfg)
    key = key or load_key(cfg.node.key_file)
    model_dir = cfg.policy.model_dir
    local_model_dir(model_dir, "policy.model_dir")
    verified = check_ledger(cfg, key, verify, record=record)
    size, version = (None, 0) if verified is None else _ledger_summary(cfg)
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
        *([] if verified is None else [_check_line(verified, verify)]),
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


def verified_path(cfg: ValidatorConfig) -> Path:
    """Where the node keeps the signed checkpoint its last ledger check verified."""
    state = cfg.node.state_path()
    return state.with_name(state.name + ".verified")


def check_ledger(
    cfg: ValidatorConfig, key: SigningKey, mode: str = MODES[0], *, record: bool = False
) -> Verified | None:
    """Verify the node's ledger read-only (None: it has no entries yet); with ``record``, keep
    the latest checkpoint verified as the next start's starting point.

    Raises ConfigError if the ledger is another key's, and LedgerError naming where the log
    first fails verification and what the operator can do."""
    since_file = verified_path(cfg)
    ledger = cfg.node.ledger_path()
    if ledger is not None and not ledger.exists():
        if record:  # a checkpoint of a ledger no longer there says nothing of the next one
            since_file.unlink(missing_ok=True)
        return None
    since = since_file.read_text() if mode != "full" and since_file.is_file() else None
    store = open_store(cfg.node.ledger, readonly=True)
    try:
        try:
            first = store.entry(0)
        except storage_errors():  # a PostgreSQL database no node has initialised yet
            return None
        if first is None and store.size() == 0:
            return None
        if first is not None:
            _check_log_key(cfg, key, first[1])
        log = Verifier(cfg.node.origin, 0x01, key.public)
        verified = verify_full(store, log) if mode == "full" else verify_since(store, log, since)
    except LedgerCheckError as exc:
        kept = f" (kept in {since_file})" if "last verified" in exc.where else ""
        raise LedgerError(
            f"the ledger fails verification at {exc.where}{kept}: {exc.what}; the node will "
            "not serve it: restore the ledger from a backup, or list every damaged entry with "
            f"`prooftrain audit verify {redact(cfg.node.ledger)}`",
            reason=exc.reason,
        ) from None
    finally:
        store.close()
    if record and verified.checkpoint is not None and verified.checkpoint != since:
        write_atomically(since_file, verified.checkpoint.encode())
    return verified


def check_paths(cfg: ValidatorConfig) -> None:
    """ConfigError, in one line, for the first file the node reads that it cannot read, or
    that it writes (the SQLite ledger, the state file, the blob store, and the directories
    their companion files go to) that it cannot write. A path not created yet needs a
    writable directory above it."""
    n = cfg.node
    reads = [(n.key_file, "validator key", "node.key_file")]
    if n.trainer_key and Path(n.trainer_key).exists():
        reads.append((Path(n.trainer_key), "trainer key", "node.trainer_key"))
    if cfg.audit.tolerance_file is not None:
        reads.append((cfg.audit.tolerance_file, "tolerance file", "audit.tolerance_file"))
    if cfg.task.jsonl is not None:
        reads.append((cfg.task.jsonl, "task file", "task.jsonl"))
    reads.append((cfg.policy.model_dir, "model directory", "policy.model_dir"))
    for path, what, setting in reads:
        if path.exists() and not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            raise ConfigError(f"{what} {path} is not readable by this user ({setting})")
    writes = [(n.state_path(), "state file", "node.state_file")]
    if (ledger := n.ledger_path()) is not None:
        writes.insert(0, (ledger, "ledger", "node.ledger"))
    for path, what, setting in writes:  # and the directory of their -wal, .lock, ... files
        _writable(path, what, setting)
        _writable(path.parent, f"{what}'s directory", setting)
    blobs = n.blob_path()
    _writable(blobs, "blob store", "node.blob_dir")
    if blobs.is_dir():
        for sub in blobs.iterdir():
            if sub.is_dir():
                _writable(sub, "blob store directory", "node.blob_dir")


def _writable(path: Path, what: str, setting: str) -> None:
    target = path
    while not target.exists() and target != target.parent:
        target = target.parent  # where the node would create it
    mode = os.R_OK | os.W_OK | (os.X_OK if target.is_dir() else 0)
    if not os.access(target, mode):
        named = f"{what} {path}" if target == path else f"{what} {path} (under {target})"
        raise ConfigError(
            f"{named} is not writable by this user: fix its permissions, or set {setting}"
        )


def _check_log_key(cfg: ValidatorConfig, key: SigningKey, genesis_bytes: bytes) -> None:
    """ConfigError if entry 0 names another log key (an undecodable entry 0 is the
    verification's to report)."""
    try:
        genesis = decode_record(genesis_bytes)
    except VerificationError:
        return
    if isinstance(genesis, LogCreated) and genesis.log_key != key.public.raw:
        raise ConfigError(
            f"node.key_file {cfg.node.key_file} is not the key of the ledger "
            f"{redact(cfg.node.ledger)} (its log key is {genesis.log_key.hex()})"
        )


def _ledger_summary(cfg: ValidatorConfig) -> tuple[int | None, int]:
    """(entries, newest policy version) of a verified ledger; (None, 0) if it has no entries."""
    store = open_store(cfg.node.ledger, readonly=True)
    try:
        version = 0
        for _, _, data in store.entries():
            rec = decode_record(data)
            if isinstance(rec, PolicyPublished):
                version = max(version, rec.version)
        return store.size(), version
    finally:
        store.close()


def _check_line(verified: Verified, mode: str) -> str:
    what = (
        "every entry, node, checkpoint and reputation row"
        if mode == "full"
        else f"entries {verified.first}..{verified.size - 1}"
        if verified.size > verified.first
        else "no entry after the last verified checkpoint"
    )
    return (
        f"ledger check  {what} verified ({mode}); latest verified checkpoint "
        f"at size {verified.checkpoint_size}"
    )
