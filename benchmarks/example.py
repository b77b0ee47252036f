"""The default example's spec as the in-process benchmarks use it: evaluation and experiment trackers off unless
asked.

The example turns held-out evaluation on (issue 27) and logs to TensorBoard; a benchmark of the orchestrator, the
journal or the sink measures those, so its runs leave the evaluation rounds out (``benchmarks/learning.py``
measures them) and the trackers (``benchmarks/tracking.py`` measures them).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


def example_spec(evaluation: bool = False, logging: dict | None = None):
    """``examples/reverse-text.yaml``'s :class:`~rlrun.api.spec.RLRunSpec`, its evaluation on only if ``evaluation``,
    its ``logging`` section replaced by ``logging`` (None: no tracker)."""
    from rlrun.api.tracking import LoggingSpec
    from rlrun.manifest import load_manifest

    spec = load_manifest(MANIFEST).spec
    return spec.model_copy(
        update={
            "evaluation": spec.evaluation.model_copy(update={"enabled": evaluation}),
            "logging": LoggingSpec.model_validate(logging or {}),
        }
    )
