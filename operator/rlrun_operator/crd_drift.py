"""CRD drift: is the installed ``RLRun`` CRD the one this operator was built with?

Helm installs a chart's ``crds/`` once and never upgrades them, so after ``helm upgrade`` the
installed CRD may lack fields the operator knows. ``kubectl apply`` (field validation ``Strict``)
is then refused by the API server, but clients with ``Warn`` or ``Ignore`` (the Python and Go
clients, GitOps tools) get a 201 and the unknown field **pruned**: the run silently uses the
default. The generator annotates the CRD with a hash of its spec
(:data:`rlrun.api.crd.SCHEMA_HASH_ANNOTATION`); the operator compares it at start.

Decision: drift is reported, not refused. Refusing to start would stop every run's status and
recoveries over a schema difference that may not touch them; instead the operator logs an error at
start and posts one Warning Event (``CRDOutdated``) on each run it reconciles, naming both hashes
and the fix (``docs/operator.md``, "Upgrading": ``kubectl apply --server-side -f crds/`` before
``helm upgrade``, as KubeRay documents).
"""

from __future__ import annotations

from rlrun.api.crd import CRD_NAME, build_crd, schema_hash

#: The fix, as the log line and the Events say it.
FIX = "apply the chart's CRD before upgrading: kubectl apply --server-side -f crds/ (Helm never upgrades crds/)"


def expected_hash() -> str:
    """The schema hash of the CRD this operator was built with."""
    return schema_hash(build_crd()["spec"])


def drift(installed: str | None, readable: bool = True) -> str | None:
    """A sentence saying how the installed CRD differs, or None when it is this operator's.

    Args:
        installed: the installed CRD's schema-hash annotation (None: it has none, e.g. installed by an older chart).
        readable: False when the CRD could not be read (the sentence says so instead of guessing).
    """
    if not readable:
        return f"could not read CustomResourceDefinition {CRD_NAME} to check it is this operator's; {FIX}"
    want = expected_hash()
    if installed == want:
        return None
    have = f"schema hash {installed}" if installed else "no schema hash (an older chart's)"
    return (
        f"the installed CustomResourceDefinition {CRD_NAME} is not this operator's ({have}, expected {want}): "
        f"fields it lacks are pruned from RLRuns written by clients that do not validate strictly; {FIX}"
    )
