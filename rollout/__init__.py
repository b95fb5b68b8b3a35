"""Contributor side: generation backends, building and signing rollout envelopes."""
