"""Rollout: engine client, builtin engine server, sglang launcher, routing, generate fns, rewards."""
