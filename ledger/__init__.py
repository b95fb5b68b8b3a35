"""Tamper-evident ledger: RFC 9162 log, signed checkpoints, storage, reputation, audit.

Every verdict, slash, assignment, policy release and epoch secret is appended
to an RFC 9162 Merkle log (SHA-256, 0x00 leaf / 0x01 node prefixes) whose
entries are the canonical bytes of typed records (:mod:`ledger.records`).
Tree heads are C2SP ``tlog-checkpoint`` signed notes; witnesses may add
``cosignature/v1`` lines; single entries are proven with self-contained
C2SP ``tlog-proof@v1`` files. Anyone can check all of it offline from public
keys alone (:mod:`ledger.audit`, ``prooftrain audit``).

Python API (what the validator calls)::

    from ledger import Ledger, ReputationParams
    from ledger.records import VerdictRecorded, Slashed, ...

    ledger = Ledger.open("validator.ledger",           # SQLite file (WAL), or
                         # "postgresql://user@host/db" (several validators, one log)
                         signing_key=key,              # verify.keys.SigningKey (the log key)
                         origin="validator.example/ledger",
                         params=ReputationParams())    # fixed in entry 0 at creation
    i = ledger.append(record)                          # -> index (one transaction)
    r = ledger.append_many(records, checkpoint=True)   # -> range; one transaction, batched
    j = ledger.slash(contributor, Reason.LOGPROB_MISMATCH, evidence_bytes, "detail")
    cp = ledger.checkpoint()                           # -> SignedCheckpoint (.to_text())
    proof = ledger.prove(i)                            # -> TlogProof (.to_text(): tlog-proof@v1)
    ledger.inclusion_proof(i, size); ledger.consistency_proof(m, n); ledger.root(size)
    ledger.cosign(witness, timestamp)                  # witness checks consistency, cosigns
    ledger.reputation(pubkey)                          # -> ReputationState (score, banned, ...)
    ledger.audit_rate(pubkey)                          # -> probability of a spot check
    ledger.is_banned(pubkey)
    for index, record in ledger.entries(cursor): ...  # resume from any index
    ledger.size(); ledger.verifier.vkey(); ledger.blobs.put(data) / .get(digest)

Guarantees: an ``append_many`` call is atomic (entries, tree nodes,
reputation rows and optional checkpoint commit together); checkpoints only
grow and are consistent with each other; reputation is a pure function of the
log (``audit verify`` replays it and compares bit for bit); large data lives in
a content-addressed blob store (``<ledger>.blobs/``) referenced by blake3 digest.
"""

from ledger.checkpoint import Checkpoint, SignedCheckpoint, TlogProof, Witness
from ledger.log import Ledger
from ledger.reputation import ReputationParams, ReputationState

__all__ = [
    "Checkpoint",
    "Ledger",
    "ReputationParams",
    "ReputationState",
    "SignedCheckpoint",
    "TlogProof",
    "Witness",
]
