"""Experiment trackers (``spec.logging``): each step logged once, as its final values, to one tracker run across
every attempt. :mod:`.steps` reads the final values, :mod:`.backends` holds W&B and TensorBoard, and
:mod:`.publisher` is the orchestrator's thread that logs them (``docs/observability.md``, "Experiment trackers").
"""
