"""Hypothesis strategies for every wire type in verify/types.py."""

from __future__ import annotations

from hypothesis import strategies as st

from verify import types as T

d32 = st.binary(min_size=32, max_size=32)
d16 = st.binary(min_size=16, max_size=16)
sig = st.binary(min_size=64, max_size=64)
u32 = st.integers(0, 2**32 - 1)
u63 = st.integers(0, 2**63 - 1)
short = st.text(max_size=40)

sampling = st.builds(
    T.SamplingParams,
    temperature=st.floats(0.0, 16.0, allow_nan=False),
    top_p=st.floats(1e-6, 1.0, allow_nan=False),
    top_k=u32,
    max_tokens=st.integers(1, T.MAX_TOKENS_HARD),
    seed=u63,
)


@st.composite
def rollout_header(draw: st.DrawFn) -> T.RolloutHeader:
    size = draw(st.integers(1, T.MAX_GROUP_HARD))
    return T.RolloutHeader(
        schema_version=draw(u32),
        contributor_key=draw(d32),
        policy_version=draw(u63),
        manifest_digest=draw(d32),
        task_id=draw(short),
        prompt_id=draw(short),
        prompt_digest=draw(d32),
        assignment_id=draw(d16),
        nonce=draw(d32),
        sampling=draw(sampling),
        group_index=draw(st.integers(0, size - 1)),
        group_size=size,
        token_count=draw(st.integers(0, T.MAX_TOKENS_HARD)),
        commitment_root=draw(d32),
        chunk_size=draw(st.integers(1, T.MAX_TOKENS_HARD)),
        created_at_ms=draw(u63),
        precision=draw(short),
        backend=draw(short),
    )


@st.composite
def rollout_body(draw: st.DrawFn) -> T.RolloutBody:
    n = draw(st.integers(0, 64))
    return T.RolloutBody(
        draw(st.binary(min_size=4 * n, max_size=4 * n)),
        draw(st.binary(min_size=4 * n, max_size=4 * n)),
    )


envelope = st.builds(
    T.RolloutEnvelope, header=st.binary(max_size=300), signature=sig, body=rollout_body()
)
group = st.builds(
    T.GroupSubmission, assignment_id=d16, envelopes=st.lists(envelope, min_size=1, max_size=4)
)
assignment = st.builds(
    T.WorkAssignment,
    schema_version=u32,
    assignment_id=d16,
    validator_key=d32,
    contributor_key=d32,
    task_id=short,
    prompt_id=short,
    prompt_digest=d32,
    prompt=st.text(max_size=200),
    group_size=st.integers(1, T.MAX_GROUP_HARD),
    policy_version=u63,
    manifest_digest=d32,
    sampling=sampling,
    nonce=d32,
    issued_at_ms=u63,
    expires_at_ms=u63,
    chunk_size=st.integers(1, T.MAX_TOKENS_HARD),
    stop_token_ids=st.lists(u32, max_size=T.MAX_STOP_TOKENS),
)
signed_assignment = st.builds(T.SignedAssignment, assignment=st.binary(max_size=300), signature=sig)
verdict = st.builds(
    T.Verdict,
    schema_version=u32,
    validator_key=d32,
    assignment_id=d16,
    group_index=u32,
    envelope_digest=d32,
    accepted=st.booleans(),
    reason=short,
    reward=st.floats(allow_nan=False, allow_infinity=False),
    audited=st.booleans(),
    evidence_digest=st.one_of(st.just(b""), d32),
    decided_at_ms=u63,
)
group_verdict = st.builds(
    T.GroupVerdict, group_digest=d32, verdicts=st.lists(verdict, min_size=1, max_size=4)
)
signed_group_verdict = st.builds(
    T.SignedGroupVerdict, group_verdict=st.binary(max_size=300), signature=sig
)
shard = st.builds(
    T.ShardEntry,
    stage=u32,
    digest=d32,
    codec=short,
    nbytes=u63,
    kind=st.sampled_from(["delta", "full"]),
)
manifest = st.builds(
    T.PolicyManifest,
    schema_version=u32,
    version=u63,
    parent_digest=st.one_of(st.just(b""), d32),
    base_digest=d32,
    shards=st.lists(shard, min_size=1, max_size=8),
    trainer_key=d32,
    created_at_ms=u63,
)
signed_manifest = st.builds(T.SignedManifest, manifest=st.binary(max_size=300), signature=sig)

accepted_sample = st.builds(
    T.AcceptedSample,
    ledger_index=u63,
    envelope_digest=d32,
    contributor_key=d32,
    assignment_id=d16,
    group_index=u32,
    group_size=u32,
    policy_version=u63,
    task_id=short,
    prompt_id=short,
    prompt_ids=st.binary(max_size=64),
    token_ids=st.binary(max_size=64),
    logprobs=st.binary(max_size=64),
    temperature=st.floats(0, 4),
    top_k=u32,
    top_p=st.floats(0, 1),
    reward=st.floats(0, 1),
    audited=st.booleans(),
)
sample_batch = st.builds(
    T.SampleBatch, cursor=u63, next_cursor=u63, samples=st.lists(accepted_sample, max_size=3)
)

slash_evidence = st.builds(
    T.SlashEvidence,
    reason=short,
    envelope=st.binary(max_size=64),
    assignment=st.binary(max_size=64),
    prompt_ids=st.binary(max_size=16),
    chunks=st.lists(u32, max_size=4),
    recomputed=st.binary(max_size=16),
    token_abs=st.floats(0, 1),
    chunk_mean_abs=st.floats(0, 1),
    detail=short,
)

metric = st.builds(
    T.EvalMetric,
    name=short,
    value=st.floats(-1e6, 1e6),
    lo=st.floats(-1e6, 1e6),
    hi=st.floats(-1e6, 1e6),
)
eval_statement = st.builds(
    T.EvalStatement,
    schema_version=u32,
    version=u63,
    manifest_digest=st.one_of(st.just(b""), d32),
    task_id=short,
    split=short,
    problems=u32,
    seed=u63,
    metrics=st.lists(metric, max_size=4),
    trainer_key=d32,
    created_at_ms=u63,
)
signed_eval = st.builds(T.SignedEvalStatement, statement=st.binary(max_size=300), signature=sig)
release_file = st.builds(T.ReleaseFile, path=short, digest=d32, nbytes=u63)
release_manifest = st.builds(
    T.ReleaseManifest,
    schema_version=u32,
    version=u63,
    base_digest=d32,
    manifest_digests=st.lists(d32, max_size=4),
    weights_digest=d32,
    origin=short,
    log_key=d32,
    checkpoint_size=u63,
    checkpoint_root=d32,
    verdict_count=u63,
    verdicts_digest=d32,
    files=st.lists(release_file, max_size=4),
    trainer_key=d32,
    created_at_ms=u63,
)
signed_release = st.builds(T.SignedRelease, manifest=st.binary(max_size=300), signature=sig)

ALL = {
    T.SamplingParams: sampling,
    T.WorkAssignment: assignment,
    T.SignedAssignment: signed_assignment,
    T.RolloutHeader: rollout_header(),
    T.RolloutBody: rollout_body(),
    T.RolloutEnvelope: envelope,
    T.GroupSubmission: group,
    T.Verdict: verdict,
    T.GroupVerdict: group_verdict,
    T.SignedGroupVerdict: signed_group_verdict,
    T.ShardEntry: shard,
    T.PolicyManifest: manifest,
    T.SignedManifest: signed_manifest,
    T.AcceptedSample: accepted_sample,
    T.SampleBatch: sample_batch,
    T.SlashEvidence: slash_evidence,
    T.EvalMetric: metric,
    T.EvalStatement: eval_statement,
    T.SignedEvalStatement: signed_eval,
    T.ReleaseFile: release_file,
    T.ReleaseManifest: release_manifest,
    T.SignedRelease: signed_release,
}
