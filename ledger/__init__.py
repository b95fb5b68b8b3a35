"""Tamper-evident ledger: RFC 9162 log, signed checkpoints, storage, reputation, audit."""
