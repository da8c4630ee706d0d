"""rltool: composable RL post-training stages for LLMs (rollout engines, trainers, weight sync)."""

__version__ = "0.1.0"
