"""The orchestrator: one asyncio process that turns tasks into trained batches.

Stages (ARCHITECTURE.md): :class:`~rlrun.orchestrator.source.TrainSource` →
:class:`~rlrun.orchestrator.dispatcher.Dispatcher` → :class:`~rlrun.orchestrator.sink.TrainSink`
→ shipped batches, bounded by :mod:`~rlrun.orchestrator.flow`; the
:class:`~rlrun.orchestrator.follower.WeightFollower` brings new policy versions to the rollout
servers; the :class:`~rlrun.orchestrator.checkpointing.CheckpointManager` writes the sink
snapshot; :mod:`~rlrun.orchestrator.resume` begins an attempt; :mod:`~rlrun.orchestrator.loop`
ties them together. ``docs/design.md`` maps every module to its job and invariant.
"""
