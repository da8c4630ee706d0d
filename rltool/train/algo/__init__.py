"""RL algorithms as pure functions of tensors, shared by every trainer backend."""
