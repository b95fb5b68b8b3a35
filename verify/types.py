"""Wire types: one frozen struct per message, with its producer and consumer.

Encoding is msgpack through msgspec with ``array_like=True`` structs: every
struct is an array in field order, so there are no maps on the wire and no
key-order ambiguity. Integers are encoded in their shortest form, floats as
IEEE-754 float64. Token ids travel as little-endian uint32 bytes and logprobs
as little-endian float32 bytes.

Signed structs (``RolloutHeader``, ``PolicyManifest``, ``WorkAssignment``,
``GroupVerdict``, ``EvalStatement``, ``ReleaseManifest``) are carried as their
canonical bytes next to the signature, so the signature covers exactly the
bytes on the wire. ``canonical_bytes`` is the one function that makes those
bytes; decoders re-encode what they parsed and reject any input that is not
byte-for-byte canonical (a float32 where a float64 belongs, a non-minimal
integer, ...), so two encodings of one message cannot both verify.

Hard caps below bound every length a decoder will accept. They are checked
by msgspec while it parses, and the total input size is checked before
parsing starts, so a hostile length prefix cannot make a decoder allocate more
than the input it was given.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

from verify.errors import DecodeError, Reason

SCHEMA_VERSION = 1
ROLLOUT_SCHEMA_VERSION = 2
"""Schema of ``WorkAssignment`` and ``RolloutHeader``. Version 2 added the assignment's
``chunk_size`` and ``stop_token_ids`` (the validator fixes both), the sampler's name in
``SamplingParams`` and the header's declared ``precision`` and ``backend``; a version-1
rollout (drawn with the Gumbel-max sampler, unnamed) is refused with SCHEMA_VERSION."""

# Hard caps. Configurable limits (validator config) are lower and are checked
# after decoding; these protect the decoder itself.
MAX_TOKENS_HARD = 65_536
MAX_GROUP_HARD = 256
MAX_SHARDS_HARD = 1_024
MAX_STR = 256
MAX_PROMPT_CHARS = 65_536
MAX_STOP_TOKENS = 16
MAX_ENVELOPE_BYTES_HARD = 8 * MAX_TOKENS_HARD + 4_096
MAX_GROUP_BYTES_HARD = 64 * 1024 * 1024

Digest = Annotated[bytes, Meta(min_length=32, max_length=32)]
Key = Annotated[bytes, Meta(min_length=32, max_length=32)]
Sig = Annotated[bytes, Meta(min_length=64, max_length=64)]
Nonce = Annotated[bytes, Meta(min_length=32, max_length=32)]
AssignmentId = Annotated[bytes, Meta(min_length=16, max_length=16)]
ShortStr = Annotated[str, Meta(max_length=MAX_STR)]
U32 = Annotated[int, Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
TokenBytes = Annotated[bytes, Meta(max_length=4 * MAX_TOKENS_HARD)]
PromptText = Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
HeaderBytes = Annotated[bytes, Meta(max_length=4_096)]
ManifestBytes = Annotated[bytes, Meta(max_length=64 * MAX_SHARDS_HARD + 4_096)]
VERDICT_MAX_BYTES = 1_280  # one canonical Verdict, with a reason of MAX_STR four-byte characters
GroupVerdictBytes = Annotated[bytes, Meta(max_length=MAX_GROUP_HARD * VERDICT_MAX_BYTES + 64)]


class _Wire(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Base of every wire struct: frozen, array-like, strict."""


class SamplingParams(_Wire, frozen=True):
    """Claimed sampling parameters; part of the signed header.

    temperature == 0 means greedy. top_k == 0 and top_p == 1.0 disable those filters.
    ``sampler`` names the verifiable sampler (``verify.samplers``: ``icdf-v1``,
    ``gumbel-v1``); the validator chooses it in the assignment.
    """

    temperature: Annotated[float, Meta(ge=0.0, le=16.0)]
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)]
    top_k: U32
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_HARD)]
    seed: U64
    sampler: ShortStr = "icdf-v1"


class WorkAssignment(_Wire, frozen=True):
    """validator -> contributor: one prompt, G completions, a fresh nonce.

    The validator fixes the stopping rule and the commitment's chunk size: a completion
    ends at its first token in ``stop_token_ids`` (kept) or after ``sampling.max_tokens``
    tokens, whichever comes first, and its header's ``chunk_size`` equals this one.
    """

    schema_version: U32
    assignment_id: AssignmentId
    validator_key: Key
    contributor_key: Key
    task_id: ShortStr
    prompt_id: ShortStr
    prompt_digest: Digest
    prompt: PromptText
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_HARD)]
    policy_version: U64
    manifest_digest: Digest
    sampling: SamplingParams
    nonce: Nonce
    issued_at_ms: U64
    expires_at_ms: U64
    chunk_size: Annotated[int, Meta(ge=1, le=MAX_TOKENS_HARD)]
    stop_token_ids: Annotated[list[U32], Meta(max_length=MAX_STOP_TOKENS)]


class SignedAssignment(_Wire, frozen=True):
    """validator -> contributor: canonical ``WorkAssignment`` bytes + validator signature."""

    assignment: ManifestBytes
    signature: Sig


class RolloutHeader(_Wire, frozen=True):
    """contributor -> validator (signed): everything a rollout claims about itself.

    The header binds the body through ``commitment_root`` (a Merkle root over
    chunks of ``chunk_size`` tokens, each leaf binding token ids and float32
    logprobs; see ``verify.commitment``). ``precision`` declares the dtype the contributor
    generated in (``float32``, ``bfloat16``, ``float16``); the validator compares its
    logprobs under that precision's calibrated tolerance. ``backend`` names the generation
    engine (``transformers``, ``vllm``), for the record.
    """

    schema_version: U32
    contributor_key: Key
    policy_version: U64
    manifest_digest: Digest
    task_id: ShortStr
    prompt_id: ShortStr
    prompt_digest: Digest
    assignment_id: AssignmentId
    nonce: Nonce
    sampling: SamplingParams
    group_index: Annotated[int, Meta(ge=0, lt=MAX_GROUP_HARD)]
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_HARD)]
    token_count: Annotated[int, Meta(ge=0, le=MAX_TOKENS_HARD)]
    commitment_root: Digest
    chunk_size: Annotated[int, Meta(ge=1, le=MAX_TOKENS_HARD)]
    created_at_ms: U64
    precision: ShortStr
    backend: ShortStr


class RolloutBody(_Wire, frozen=True):
    """contributor -> validator: the completion's token ids (u32 LE) and committed logprobs (f32 LE)."""

    token_ids: TokenBytes
    logprobs: TokenBytes


class RolloutEnvelope(_Wire, frozen=True):
    """contributor -> validator: canonical header bytes, the contributor's signature, the body."""

    header: HeaderBytes
    signature: Sig
    body: RolloutBody


class GroupSubmission(_Wire, frozen=True):
    """contributor -> validator: the G rollouts of one assignment, in group-index order."""

    assignment_id: AssignmentId
    envelopes: Annotated[list[RolloutEnvelope], Meta(min_length=1, max_length=MAX_GROUP_HARD)]


class Verdict(_Wire, frozen=True):
    """validator -> contributor, ledger, trainer: the outcome for one rollout."""

    schema_version: U32
    validator_key: Key
    assignment_id: AssignmentId
    group_index: U32
    envelope_digest: Digest
    accepted: bool
    reason: ShortStr
    reward: float
    audited: bool
    evidence_digest: Annotated[bytes, Meta(max_length=32)]
    decided_at_ms: U64


class GroupVerdict(_Wire, frozen=True):
    """validator -> contributor: the verdicts on every rollout of one submitted group.

    A group is judged as a unit (one failing member makes the others
    GROUP_REJECTED), so the validator signs its verdicts once, together, in
    the order it judged them. Every verdict names the same validator and
    assignment, and ``group_digest`` names the exact submission bytes judged
    (``verify.envelope.group_digest``), so a contributor can tell which of its
    submissions an answer is for (``verify.signed.open_group_verdict``).
    """

    group_digest: Digest
    verdicts: Annotated[list[Verdict], Meta(min_length=1, max_length=MAX_GROUP_HARD)]


class SignedGroupVerdict(_Wire, frozen=True):
    """validator -> contributor: canonical ``GroupVerdict`` bytes + validator signature."""

    group_verdict: GroupVerdictBytes
    signature: Sig


class ShardEntry(_Wire, frozen=True):
    """One pipeline stage's published update inside a ``PolicyManifest``."""

    stage: U32
    digest: Digest
    codec: ShortStr
    nbytes: U64
    kind: ShortStr  # "delta" (applies to the parent) or "full" (a snapshot)


class PolicyManifest(_Wire, frozen=True):
    """trainer -> contributors, validators (signed): how to build policy ``version``."""

    schema_version: U32
    version: U64
    parent_digest: Annotated[bytes, Meta(max_length=32)]  # empty for the base version
    base_digest: Digest
    shards: Annotated[list[ShardEntry], Meta(min_length=1, max_length=MAX_SHARDS_HARD)]
    trainer_key: Key
    created_at_ms: U64


class SignedManifest(_Wire, frozen=True):
    """trainer -> contributors, validators: canonical ``PolicyManifest`` bytes + trainer signature."""

    manifest: ManifestBytes
    signature: Sig


class AcceptedSample(_Wire, frozen=True):
    """validator -> trainer: one accepted rollout, in ledger order.

    ``logprobs`` are the committed behaviour logprobs (the importance-sampling
    denominator); ``reward`` was computed by the validator.
    """

    ledger_index: U64
    envelope_digest: Digest
    contributor_key: Key
    assignment_id: AssignmentId
    group_index: U32
    group_size: U32
    policy_version: U64
    task_id: ShortStr
    prompt_id: ShortStr
    prompt_ids: TokenBytes  # u32 LE, the tokenized prompt the validator assigned
    token_ids: TokenBytes  # u32 LE
    logprobs: TokenBytes  # f32 LE
    temperature: float
    top_k: U32
    top_p: float
    reward: float
    audited: bool


class SampleBatch(_Wire, frozen=True):
    """validator -> trainer: accepted samples from ``cursor``; resume from ``next_cursor``."""

    cursor: U64
    next_cursor: U64
    samples: Annotated[list[AcceptedSample], Meta(max_length=4_096)]


class SlashEvidence(_Wire, frozen=True):
    """validator -> ledger, auditors: what a third party needs to re-check a slash offline.

    ``envelope`` is the contributor-signed envelope (canonical bytes);
    ``assignment`` the validator-signed assignment it answered (canonical
    ``SignedAssignment`` bytes). For spot-check offences ``recomputed`` holds the
    validator's float32 logprobs for every completion token under the claimed
    policy version, so anyone holding that version can repeat the comparison.
    """

    reason: ShortStr
    envelope: Annotated[bytes, Meta(max_length=MAX_ENVELOPE_BYTES_HARD)]
    assignment: ManifestBytes
    prompt_ids: TokenBytes
    chunks: Annotated[list[U32], Meta(max_length=MAX_TOKENS_HARD)]
    recomputed: TokenBytes
    token_abs: float
    chunk_mean_abs: float
    detail: Annotated[str, Meta(max_length=1_024)]
    replay_slack: float = 0.0


MAX_EVAL_METRICS = 64
MAX_RELEASE_VERSIONS = 1 << 20
MAX_RELEASE_FILES = 1 << 16
ReleaseBytes = Annotated[bytes, Meta(max_length=32 * 1024 * 1024)]


class EvalMetric(_Wire, frozen=True):
    """trainer -> validator, release readers (inside an ``EvalStatement``): one figure and its
    95% interval [lo, hi]."""

    name: ShortStr
    value: float
    lo: float
    hi: float


class EvalStatement(_Wire, frozen=True):
    """trainer -> validator, ledger, release readers (signed): an evaluation of one policy version.

    ``manifest_digest`` is that version's manifest digest, empty for version 0
    (the base model). ``problems`` problems of ``task_id``/``split`` drawn with ``seed``.
    """

    schema_version: U32
    version: U64
    manifest_digest: Annotated[bytes, Meta(max_length=32)]
    task_id: ShortStr
    split: ShortStr
    problems: U32
    seed: U64
    metrics: Annotated[list[EvalMetric], Meta(max_length=MAX_EVAL_METRICS)]
    trainer_key: Key
    created_at_ms: U64


class SignedEvalStatement(_Wire, frozen=True):
    """trainer -> validator: canonical ``EvalStatement`` bytes + trainer signature."""

    statement: ManifestBytes
    signature: Sig


class ReleaseFile(_Wire, frozen=True):
    """trainer -> release readers (inside a ``ReleaseManifest``): one file of a release
    directory, its '/'-separated relative path, blob digest and size."""

    path: ShortStr
    digest: Digest
    nbytes: U64


class ReleaseManifest(_Wire, frozen=True):
    """trainer -> anyone (signed): what a release directory holds and where it came from.

    ``manifest_digests`` are the policy manifests of versions 1..``version``;
    ``weights_digest`` is the release verifier's ``tensor_digest`` of the released
    weights; the checkpoint fields name the validator-signed tree head every
    shipped proof verifies against; ``verdict_count``/``verdicts_digest``
    summarise the accepted verdicts before ``version`` was published; ``files``
    lists every other file of the directory (the release verifier checks it).
    """

    schema_version: U32
    version: U64
    base_digest: Digest
    manifest_digests: Annotated[list[Digest], Meta(max_length=MAX_RELEASE_VERSIONS)]
    weights_digest: Digest
    origin: ShortStr
    log_key: Key
    checkpoint_size: U64
    checkpoint_root: Digest
    verdict_count: U64
    verdicts_digest: Digest
    files: Annotated[list[ReleaseFile], Meta(max_length=MAX_RELEASE_FILES)]
    trainer_key: Key
    created_at_ms: U64


class SignedRelease(_Wire, frozen=True):
    """trainer -> anyone: canonical ``ReleaseManifest`` bytes + trainer signature."""

    manifest: ReleaseBytes
    signature: Sig


T = TypeVar("T", bound=Struct)

_ENCODER = msgspec.msgpack.Encoder()


def canonical_bytes(obj: Struct) -> bytes:
    """The one canonical encoding of a wire struct (what signatures and digests cover)."""
    return _ENCODER.encode(obj)


_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def _decoder(cls: type[T]) -> msgspec.msgpack.Decoder:
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    return dec


def decode(cls: type[T], data: bytes, *, max_bytes: int, canonical: bool = True) -> T:
    """Parse ``data`` as ``cls``; enforce ``max_bytes`` before parsing.

    With ``canonical=True`` the input must be exactly ``canonical_bytes`` of the
    result. Raises :class:`DecodeError` with reason TOO_LARGE, TRUNCATED,
    TRAILING_BYTES or MALFORMED.
    """
    if len(data) > max_bytes:
        raise DecodeError(
            f"{cls.__name__} input is too large",
            reason=Reason.TOO_LARGE,
            expected=f"<= {max_bytes}",
            computed=len(data),
        )
    try:
        obj = _decoder(cls).decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"{cls.__name__}: {exc}", reason=_classify(str(exc))) from None
    if canonical and canonical_bytes(obj) != bytes(data):
        raise DecodeError(f"{cls.__name__} encoding is not canonical", reason=Reason.MALFORMED)
    return obj


def _classify(message: str) -> Reason:
    lowered = message.lower()
    if "truncated" in lowered:
        return Reason.TRUNCATED
    if "trailing" in lowered:
        return Reason.TRAILING_BYTES
    return Reason.MALFORMED


def to_builtins(obj: Any) -> Any:
    """JSON-friendly view of a wire struct (bytes as hex), for logs and reports."""
    if isinstance(obj, Struct):
        return {name: to_builtins(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, (list, tuple)):
        return [to_builtins(v) for v in obj]
    return obj
