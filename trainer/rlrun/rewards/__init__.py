"""Reward functions: builtin ones by name, any callable by import path, and their scoring.

A reward function follows TRL ``GRPOTrainer``'s convention, so one written for TRL runs here
unchanged: called once per group with ``prompts``, ``completions``, ``completion_ids`` and every
other task field (``answer``, a dataset's other columns) as keyword arguments, one list item per
completion, sync or async; returns one score (or ``None``: does not apply) per completion.

- :mod:`.builtin`: ``exact``, ``math`` (math-verify), ``lcs``, ``regex`` (:data:`BUILTIN_REWARDS`);
- :mod:`.loading`: a :class:`~rlrun.api.spec.RewardSpec` to a callable, with typed errors;
- :mod:`.scoring`: a group's scores, weighted and checked, off the event loop with a timeout: in worker
  threads, or in worker processes (:mod:`.workers`, :mod:`.worker`) for a reward whose ``isolation`` says so.
"""
