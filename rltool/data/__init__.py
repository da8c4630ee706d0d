"""Rollout shards (Parquet), tiny tokenizers and models, built-in tasks and rewards."""
