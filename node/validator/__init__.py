"""The validator node: assignment, admission, rewards, spot checks, verdicts, sample stream.

``core.Validator`` holds the logic and state (no sockets), with its admission
phases in ``checks`` (attributed checks, rewards, audit draw) and ``record``
(verdicts to the ledger), the epoch-secret lifecycle in ``epochs`` and the
trainer's endpoints in ``trainer_side``; ``service`` wraps it in a FastAPI
app; ``spot`` runs spot checks and builds slash evidence that a third party
can re-check; ``state`` persists what the ledger does not hold (accepted
sample bodies, idempotent submission results).
"""
