"""Assemble a validator from its config: key, ledger, state, model, tasks, tolerance."""

from __future__ import annotations

import os
from pathlib import Path

from ledger.log import Ledger
from node.config import ValidatorConfig
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.state import State, StateStore
from rewards.base import Problem
from rewards.tasks.base import generate
from rewards.tasks.jsonl import load_jsonl
from rollout.loading import local_model_dir
from rollout.oracle import TransformersOracle
from rollout.sync import PolicySync
from verify.errors import ConfigError, Reason, VerificationError
from verify.keys import PublicKey, SigningKey, load_public_key, load_signing_key
from verify.spotcheck import FLOAT32_TOLERANCE, Tolerances
from verify.types import PolicyManifest, SignedManifest, decode

PASSPHRASE_ENV = "PROOFTRAIN_KEY_PASSPHRASE"


def load_problems(cfg: ValidatorConfig) -> list[Problem]:
    if cfg.task.jsonl is not None:
        return load_jsonl(cfg.task.jsonl, limit=cfg.task.pool)
    return generate(cfg.task.name, "train", cfg.task.pool, seed=cfg.task.seed)


def load_tolerance(cfg: ValidatorConfig) -> Tolerances:
    """Each declared precision's bound: the calibrated file's, else the built-in float32 one.

    Without a file only float32 rollouts are admitted (others: UNSUPPORTED_PRECISION, not
    slashed). bfloat16 noise depends on the model: the built-in bfloat16 bound, measured on the
    demo policy, rejects honest bfloat16 rollouts of SmolLM2-135M (vocabulary 49,152), so
    bfloat16, declared or recomputed, needs a calibration of the node's own model."""
    if cfg.audit.tolerance_file is None:
        if cfg.policy.dtype != "float32":
            raise ConfigError(
                f"policy.dtype = {cfg.policy.dtype!r} needs audit.tolerance_file: honest "
                "noise in that precision depends on the model; measure it with "
                "`prooftrain calibrate MODEL_DIR --recompute-dtype "
                f"{cfg.policy.dtype} --out FILE`"
            )
        return Tolerances({"float32": FLOAT32_TOLERANCE})
    from node.validator.calibration import load_tolerance_file

    return load_tolerance_file(
        cfg.audit.tolerance_file, min_tokens=cfg.audit.min_calibration_tokens
    )


def load_key(path: Path) -> SigningKey:
    if not path.exists():
        raise ConfigError(
            f"validator key {path} does not exist; create it with "
            f"`prooftrain keys new --out {path}`"
        )
    passphrase = os.environ.get(PASSPHRASE_ENV)
    return load_signing_key(path, passphrase.encode() if passphrase else None)


def trainer_key(cfg: ValidatorConfig) -> PublicKey | None:
    return load_public_key(cfg.node.trainer_key) if cfg.node.trainer_key else None


def build_validator(cfg: ValidatorConfig, key: SigningKey | None = None) -> Validator:
    key = key or load_key(cfg.node.key_file)
    model_dir = cfg.policy.model_dir
    local_model_dir(model_dir, "policy.model_dir")
    cfg.node.blob_path().mkdir(parents=True, exist_ok=True)  # what `audit verify --blobs` reads
    ledger = Ledger.open(
        cfg.node.ledger, signing_key=key, origin=cfg.node.origin, blobs=cfg.node.blob_path()
    )
    codec = HFTextCodec(model_dir)
    state = open_state(cfg)
    trainer = trainer_key(cfg)
    versions = PolicyVersions(model_dir_digest(model_dir), trainer)
    oracle = TransformersOracle(
        policy_loader(model_dir, trainer, state, ledger),
        dtype=cfg.policy.dtype,
        max_versions=cfg.rules.max_staleness + 2,
    )
    return Validator(
        cfg, key, ledger, state, codec, oracle, load_problems(cfg), versions, load_tolerance(cfg)
    )


def open_state(cfg: ValidatorConfig) -> State:
    """The node's state store: its own SQLite file, or on a PostgreSQL log the shared tables
    beside the log (what a trainer or another node reads) with its own file for the rest."""
    local = StateStore(cfg.node.state_path())
    if not cfg.node.is_postgres():
        return local
    from node.validator.shared_state import SharedStateStore  # noqa: PLC0415

    try:
        return SharedStateStore(cfg.node.ledger, local)
    except BaseException:
        local.close()
        raise


def policy_loader(model_dir: Path, trainer: PublicKey | None, state: State, ledger: Ledger):  # type: ignore[no-untyped-def]
    """version -> model: the base for 0; later versions rebuilt from the manifests and blobs
    this validator stored when the trainer published them (each checked again on the way)."""
    syncs: dict[str, object] = {}

    def manifest(version: int) -> SignedManifest:
        data = state.manifest(version)
        if data is None:
            raise VerificationError(
                f"no manifest for policy version {version}", reason=Reason.NOT_FOUND
            )
        return decode(SignedManifest, data, max_bytes=len(data))

    def load(version: int):  # type: ignore[no-untyped-def]
        if version == 0:
            return model_dir
        if trainer is None or ledger.blobs is None:
            raise ConfigError("policy versions above 0 need node.trainer_key and a blob store")
        if "sync" not in syncs:
            stages = len(
                decode(PolicyManifest, manifest(version).manifest, max_bytes=1 << 20).shards
            )
            syncs["sync"] = PolicySync(model_dir, trainer, manifest, ledger.blobs.get, stages)
        return syncs["sync"].model_at(version)  # type: ignore[attr-defined]

    return load
