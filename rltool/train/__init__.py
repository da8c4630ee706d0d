"""Trainer backends (torch; megatron later), the RL algorithms in `algo/`, and the DP schedule."""
