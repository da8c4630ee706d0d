"""Alignment gates: trainer-recomputed vs rollout logprobs (gate.py) and per layer (layerwise.py)."""
