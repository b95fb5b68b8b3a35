"""Contributor side: generation backends, building and signing rollout envelopes."""

from rollout import vllm_backend  # noqa: E402,F401  (registers the "vllm" backend; vLLM loads lazily)
