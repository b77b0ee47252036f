"""The orchestrator: one asyncio process that turns tasks into trained batches.

Stages (ARCHITECTURE.md): :class:`~rlrun.orchestrator.source.TrainSource` →
:class:`~rlrun.orchestrator.dispatcher.Dispatcher` → :class:`~rlrun.orchestrator.sink.TrainSink`
→ shipped batches; :mod:`rlrun.orchestrator.weights` brings new policy versions to
the rollout servers; :mod:`rlrun.orchestrator.loop` ties them together.
"""
