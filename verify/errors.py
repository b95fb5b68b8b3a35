"""One exception hierarchy for the whole project, and one enum of reason codes.

Verification never returns False: it raises a subclass of :class:`VerificationError`
that names its :class:`Reason` and carries the expected and computed values, so a
rejection can be logged, stored in the ledger and re-checked by a third party.
The node, the ledger and the audit tools all reuse :class:`Reason`; its string
values are stable wire and storage identifiers and must never be renamed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class Reason(enum.StrEnum):
    """Every reason a thing can be rejected. Values are stable identifiers."""

    # -- parsing and limits
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    TRAILING_BYTES = "trailing_bytes"
    TRUNCATED = "truncated"
    SCHEMA_VERSION = "schema_version"
    LIMIT_TOKENS = "limit_tokens"
    LIMIT_GROUP = "limit_group"
    INCONSISTENT = "inconsistent"
    # -- identity and signatures
    BAD_KEY = "bad_key"
    UNKNOWN_KEY = "unknown_key"
    BANNED_KEY = "banned_key"
    BAD_SIGNATURE = "bad_signature"
    WRONG_SIGNER = "wrong_signer"
    BAD_PASSPHRASE = "bad_passphrase"
    REGISTRATION_WORK = "registration_work"  # no valid registration proof of work
    # -- assignment and freshness
    UNKNOWN_ASSIGNMENT = "unknown_assignment"
    ASSIGNMENT_MISMATCH = "assignment_mismatch"
    WRONG_PROMPT = "wrong_prompt"
    MISSING_GROUP_MEMBER = "missing_group_member"
    DUPLICATE_GROUP_MEMBER = "duplicate_group_member"
    REPLAY = "replay"
    DUPLICATE_COMPLETION = "duplicate_completion"
    GROUP_REJECTED = "group_rejected"  # another member of the same group was rejected
    EXPIRED_ASSIGNMENT = "expired_assignment"
    ABANDONED = "abandoned"  # an assignment expired unanswered
    STALE = "stale"
    FUTURE_VERSION = "future_version"
    ASSIGNMENT_LIMIT = "assignment_limit"  # too many assignments open or abandoned at once
    STOPPING_RULE = "stopping_rule"  # length or end of a completion breaks the assignment's rule
    UNSUPPORTED_PRECISION = (
        "unsupported_precision"  # no calibrated tolerance for the declared dtype
    )
    WRONG_MANIFEST = "wrong_manifest"
    # -- commitments and proofs
    COMMITMENT_MISMATCH = "commitment_mismatch"
    BAD_OPENING = "bad_opening"
    PROOF_WRONG_LENGTH = "proof_wrong_length"
    PROOF_WRONG_INDEX = "proof_wrong_index"
    PROOF_WRONG_SIZE = "proof_wrong_size"
    ROOT_MISMATCH = "root_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    # -- spot checks and sampling integrity
    LOGPROB_MISMATCH = "logprob_mismatch"
    TOKEN_OUTSIDE_SUPPORT = "token_outside_support"
    SAMPLER_REPLAY_MISMATCH = "sampler_replay_mismatch"
    SAMPLING_DISTRIBUTION = "sampling_distribution"
    DIVERGENCE = "divergence"
    UNKNOWN_SAMPLER = "unknown_sampler"
    # -- ledger
    LEDGER_CORRUPT = "ledger_corrupt"
    CHECKPOINT_INCONSISTENT = "checkpoint_inconsistent"
    REPUTATION_MISMATCH = "reputation_mismatch"
    # -- service
    RATE_LIMITED = "rate_limited"
    BACKPRESSURE = "backpressure"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    STORAGE_FULL = "storage_full"  # the node's disk is full: nothing was recorded, ask again later


class ProofTrainError(Exception):
    """Root of every exception prooftrain raises on purpose."""


class ConfigError(ProofTrainError):
    """A configuration file or value is invalid."""


def build_registered(
    kind: str, registry: Mapping[str, Callable[..., T]], name: str, params: Mapping[str, object]
) -> T:
    """``registry[name](**params)``; ConfigError naming ``kind`` for an unknown name (with
    the known ones) or for parameters the factory refuses (TypeError or ValueError)."""
    try:
        factory = registry[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; known: {sorted(registry)}") from None
    try:
        return factory(**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{kind} {name!r}: {exc}") from exc


class KeyFileError(ProofTrainError):
    """A key file cannot be created, read or decrypted. Never carries key bytes."""

    def __init__(self, message: str, reason: Reason = Reason.BAD_KEY) -> None:
        super().__init__(message)
        self.reason = reason


class VerificationError(ProofTrainError):
    """Something failed verification. Carries the reason and what differed.

    ``expected`` and ``computed`` are short, printable values (hex digests,
    numbers, sizes); never secrets.
    """

    reason: Reason = Reason.MALFORMED

    def __init__(
        self,
        message: str,
        *,
        reason: Reason | None = None,
        expected: Any = None,
        computed: Any = None,
    ) -> None:
        if reason is not None:
            self.reason = reason
        self.expected = expected
        self.computed = computed
        detail = ""
        if expected is not None or computed is not None:
            detail = f" (expected {_short(expected)}, computed {_short(computed)})"
        super().__init__(f"[{self.reason.value}] {message}{detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickles as it was, without running __init__ on the formatted message again
        # (admission's worker processes send these back).
        return _rebuilt, (type(self), self.args, self.__dict__)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason.value,
            "message": str(self),
            "expected": _short(self.expected),
            "computed": _short(self.computed),
        }


def _rebuilt(
    cls: type[VerificationError], args: tuple[Any, ...], state: dict[str, Any]
) -> VerificationError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class DecodeError(VerificationError):
    """Bytes do not parse into the expected structure, or break a size limit."""

    reason = Reason.MALFORMED


class SignatureError(VerificationError):
    reason = Reason.BAD_SIGNATURE


class CommitmentError(VerificationError):
    reason = Reason.COMMITMENT_MISMATCH


class ProofError(VerificationError):
    """A Merkle inclusion/consistency proof or opening does not verify."""

    reason = Reason.ROOT_MISMATCH


class AdmissionError(VerificationError):
    """A submission was refused by the validator's admission pipeline."""


class SpotCheckError(VerificationError):
    """A recomputation disagreed with what the contributor committed."""

    reason = Reason.LOGPROB_MISMATCH


class LedgerError(VerificationError):
    """The ledger's stored state does not verify."""

    reason = Reason.LEDGER_CORRUPT


def _short(value: Any, limit: int = 96) -> Any:
    if value is None or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).hex()
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
