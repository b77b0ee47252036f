"""Which LoRA adapters one rollout server holds, which one a request names, and when an old one may go.

A LoRA run (``spec.model.lora``) brings each policy version ``N`` to a server as adapter ``policy-vN``
(:func:`adapter_name`; version 0 is the base model, served under its own name). Guarantees, for the one
:class:`~rlrun.rollout.client.RolloutClient` that owns an :class:`AdapterRegistry`:

- a request names the adapter of the **newest** version the server holds (:meth:`AdapterRegistry.name`), which
  is ≥ the version the request is labelled with, since the dispatcher sends a request labelled ``v`` only to a
  server holding ``v`` or newer: the version rule of full-weight updates, unchanged;
- an adapter is unloaded only once it is older than the newest **and** no request naming it is out, so a
  request in flight always finishes on the adapter it named (no pause, no drain);
- an adapter directory is needed (vLLM reloads an adapter its cache evicted from the path it was loaded from)
  exactly while its version is in :attr:`AdapterRegistry.held`: broadcasts are pruned by that
  (:meth:`rlrun.orchestrator.follower.WeightFollower.follow`).

Pure bookkeeping: no I/O; the client sends the loads and unloads it decides.
"""

from __future__ import annotations

from collections import Counter

#: The name rlrun serves the base model under (``--served-model-name``): policy version 0, and every version of a
#: full-weights run.
SERVED_MODEL_NAME = "policy"


def adapter_name(version: int) -> str:
    """The name policy ``version`` is served under: ``policy-vN`` for an adapter, the base name at 0."""
    return f"{SERVED_MODEL_NAME}-v{version}" if version > 0 else SERVED_MODEL_NAME


class AdapterRegistry:
    """The adapters one server holds (as far as its client knows) and the requests out naming each.

    Attributes:
        held: version → the directory its adapter was loaded from, for every adapter loaded and not yet unloaded.
        out: adapter name → requests sent naming it and not yet answered (the base name counts too).
    """

    def __init__(self) -> None:
        self.held: dict[int, str] = {}
        self.out: Counter[str] = Counter()

    @property
    def newest(self) -> int:
        """The newest version held (0: none, the base model)."""
        return max(self.held, default=0)

    def name(self) -> str:
        """The name a request sent now names: the newest adapter's (:func:`adapter_name`)."""
        return adapter_name(self.newest)

    def sent(self, name: str) -> None:
        """A request naming ``name`` was sent."""
        self.out[name] += 1

    def answered(self, name: str) -> list[str]:
        """A request naming ``name`` was answered (or failed); returns the adapters to unload now (``name`` when it
        was the last request out on an adapter older than the newest)."""
        self.out[name] -= 1
        if self.out[name] <= 0:
            del self.out[name]
        return self._releasable()

    def loaded(self, version: int, path: str) -> list[str]:
        """Adapter ``version`` was loaded from ``path``; returns the adapters to unload now (older ones none names)."""
        self.held[version] = path
        return self._releasable()

    def reset(self) -> None:
        """The server lost every adapter (it restarted): nothing is held; requests out stay counted, since they
        are still answered (with an error) and counted down."""
        self.held.clear()

    def _releasable(self) -> list[str]:
        newest = self.newest
        gone = [v for v in self.held if v < newest and not self.out.get(adapter_name(v))]
        for v in gone:
            del self.held[v]
        return [adapter_name(v) for v in sorted(gone)]
