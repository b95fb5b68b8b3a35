"""Policy model, pipeline shards, off-policy losses, sample buffer, publication, evals."""
