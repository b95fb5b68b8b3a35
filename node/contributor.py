"""The contributor process: ask for work, follow the policy, generate, sign, submit.

Loop, one assignment at a time:

1. If the state file holds a group that was generated but not acknowledged,
   resubmit exactly those bytes (the validator answers an identical
   resubmission with the stored verdicts, so a restart never double-submits).
2. Otherwise ask for an assignment and record it in the state file.
3. Make sure the assigned policy version is loaded: version 0 is the local
   base model; later versions are rebuilt from trainer-signed manifests and
   compressed deltas (``rollout.sync.PolicySync``), every signature and digest
   checked before anything is decoded.
4. Generate G completions with the verifiable sampler, commit and sign them,
   record the group in the state file (atomic rename), then submit it.

Transient failures (connection errors, 429) are retried with exponential
backoff by the client; a refused submission is reported and dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.client import ServiceError, ValidatorClient
from node.validator.policy import HFTextCodec
from rollout.backends import loads_from_directory, make_backend
from rollout.sync import PolicySync, write_model_dir
from rollout.worker import answer, open_assignment
from verify.errors import ProofTrainError, Reason
from verify.keys import PublicKey, SigningKey
from verify.signed import open_sealed
from verify.types import PolicyManifest, SignedManifest, Verdict, canonical_bytes, decode

# transformers' model loading is not thread-safe; contributors sharing a process load in turn.
_LOAD_LOCK = threading.Lock()


@dataclass
class ContributorStats:
    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


class Contributor:
    def __init__(self, client: ValidatorClient, key: SigningKey, base_model_dir: Path, state_dir: Path,
                 *, backend: str = "transformers", device: str | None = None, dtype: str | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.client, self.key, self.base = client, key, Path(base_model_dir)
        self.state_path = Path(state_dir) / "contributor-state.json"
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        self.backend_name, self.device, self.dtype = backend, device, dtype
        self.codec = HFTextCodec(self.base)
        self.log = log
        self.stats = ContributorStats()
        info = client.info()
        self.validator = PublicKey.from_hex(info["validator_key"])
        self.trainer = PublicKey.from_hex(info["trainer_key"]) if info.get("trainer_key") else None
        self._sync: Any = None
        self._version: int | None = None
        self._backend: Any = None

    # -- persistent state
    def _load_state(self) -> dict[str, str]:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}

    def _save_state(self, state: dict[str, str]) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    # -- policy
    def _backend_for(self, version: int) -> Any:
        if self._version == version and self._backend is not None:
            return self._backend
        with _LOAD_LOCK:
            return self._load_backend(version)

    def _load_backend(self, version: int) -> Any:
        if version == 0:
            model: Any = str(self.base)
        else:
            if self.trainer is None:
                raise ProofTrainError("the validator names no trainer key; cannot verify policy updates")
            if self._sync is None:
                stages = len(decode_manifest(self.client.manifest(version)).shards)
                self._sync = PolicySync(self.base, self.trainer, self.client.manifest, self.client.blob, stages)
            if loads_from_directory(self.backend_name):
                model = str(self._write_policy(version))
            else:
                model = self._sync.model_at(version)
        placement = {} if self.device is None else {"device": self.device}  # else the backend's default
        if self._backend is not None and hasattr(self._backend, "close"):
            self._backend.close()  # e.g. a vLLM engine's GPU memory, before the next one loads
            self._backend = None
        self._backend = make_backend(self.backend_name, model=model, dtype=self.dtype, **placement)
        self._version = version
        return self._backend

    def _write_policy(self, version: int) -> Path:
        """The rebuilt policy as a model directory (``rollout.sync.write_model_dir``),
        replacing the previous version's; written to a temporary name, then renamed."""
        root = self.state_path.parent / "policy"
        final, tmp = root / f"v{version}", root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_model_dir(tmp, self.base, self._sync.state_at(version))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in root.glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    # -- one assignment
    def step(self) -> list[Verdict]:
        state = self._load_state()
        if "group" not in state:
            sealed = self.client.assign()
            a = open_assignment(sealed, self.validator, self.key.public)
            backend = self._backend_for(a.policy_version)
            group = answer(self.key, sealed, self.validator, backend, self.codec)
            state = {"assignment": canonical_bytes(sealed).hex(), "group": canonical_bytes(group).hex()}
            self._save_state(state)
        raw = bytes.fromhex(state["group"])
        try:
            signed = self.client.submit(raw)
        except ServiceError as exc:
            self.stats.rejected += 1
            self.stats.reasons[exc.reason.value] = self.stats.reasons.get(exc.reason.value, 0) + 1
            self.log(f"submission refused: {exc}")
            self._save_state({})
            if exc.reason in (Reason.UNKNOWN_KEY, Reason.BANNED_KEY):
                raise
            return []
        verdicts = [open_sealed(Verdict, s, self.validator) for s in signed]
        self._save_state({})
        self.stats.submitted += 1
        for v in verdicts:
            if v.accepted:
                self.stats.accepted += 1
            else:
                self.stats.rejected += 1
                self.stats.reasons[v.reason] = self.stats.reasons.get(v.reason, 0) + 1
        return verdicts

    def run(self, groups: int | None = None, *, idle_s: float = 1.0) -> ContributorStats:
        done = 0
        while groups is None or done < groups:
            try:
                verdicts = self.step()
            except ServiceError as exc:
                if exc.reason in (Reason.UNKNOWN_KEY, Reason.BANNED_KEY):
                    self.log(f"stopping: {exc}")
                    break
                self.log(f"validator busy: {exc}; waiting {idle_s:.0f} s")
                time.sleep(idle_s)
                continue
            done += 1
            ok = sum(v.accepted for v in verdicts)
            self.log(f"group {done}: {ok}/{len(verdicts)} accepted"
                     + (f" ({', '.join(sorted({v.reason for v in verdicts if v.reason}))})" if ok < len(verdicts) else ""))
        return self.stats


def decode_manifest(sealed: SignedManifest) -> PolicyManifest:
    return decode(PolicyManifest, sealed.manifest, max_bytes=len(sealed.manifest))
