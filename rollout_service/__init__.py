"""rollout_service: reward groups for RL post-training, generated on vLLM against step-driven environments."""

__version__ = "0.1.0"
