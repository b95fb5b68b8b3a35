"""Runnable roles and their I/O: validator service, trainer, contributor, CLI."""
