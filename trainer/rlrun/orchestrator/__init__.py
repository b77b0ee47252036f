"""The orchestrator: one asyncio process that turns tasks into trained batches.

Its modules, in the five groups of ``docs/design.md``'s map (the package stays flat; each module's job and
invariant are there):

- **pipeline** — tasks → rollouts → scored groups → shipped batches: :mod:`~rlrun.orchestrator.source` (the next
  task), :mod:`~rlrun.orchestrator.groups`, :mod:`~rlrun.orchestrator.dispatcher`,
  :mod:`~rlrun.orchestrator.episodes`, :mod:`~rlrun.orchestrator.prompts`, :mod:`~rlrun.orchestrator.turns`,
  :mod:`~rlrun.orchestrator.admission`, :mod:`~rlrun.orchestrator.flow` (the dispatch budget),
  :mod:`~rlrun.orchestrator.staleness`, :mod:`~rlrun.orchestrator.sink` (score, queue, cut batches),
  :mod:`~rlrun.orchestrator.advantages`, :mod:`~rlrun.orchestrator.cancellation`,
  :mod:`~rlrun.orchestrator.no_signal`;
- **rollout fleet** — the rollout servers, their weights and liveness: :mod:`~rlrun.orchestrator.endpoints`,
  :mod:`~rlrun.orchestrator.liveness`, :mod:`~rlrun.orchestrator.follower` (new policy versions to the servers),
  :mod:`~rlrun.orchestrator.weights`;
- **durability** — what survives a kill, a pause or a stop: :mod:`~rlrun.orchestrator.journal`,
  :mod:`~rlrun.orchestrator.journal_files`, :mod:`~rlrun.orchestrator.conversations`,
  :mod:`~rlrun.orchestrator.snapshot`, :mod:`~rlrun.orchestrator.checkpointing` (the sink snapshot written),
  :mod:`~rlrun.orchestrator.resume` (how an attempt begins), :mod:`~rlrun.orchestrator.signals`;
- **reporting** — what the run says of itself: :mod:`~rlrun.orchestrator.metrics`,
  :mod:`~rlrun.orchestrator.prometheus`, :mod:`~rlrun.orchestrator.view` (the read-only view they read),
  :mod:`~rlrun.orchestrator.evaluation`;
- **wiring** — the stages put together and reached from outside: :mod:`~rlrun.orchestrator.loop` (the
  ``Orchestrator`` and its main loop), :mod:`~rlrun.orchestrator.main` (``rlrun orchestrator``'s role),
  :mod:`~rlrun.orchestrator.control` (the control server).
"""
