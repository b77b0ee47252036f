"""Rollout servers: vLLM's OpenAI-compatible server plus rlrun's weight-reload extension."""
