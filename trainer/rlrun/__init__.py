"""rlrun: preemption-safe asynchronous RL training for LLMs (``docs/design.md`` maps every module)."""
