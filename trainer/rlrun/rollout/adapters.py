"""Which LoRA adapters one rollout server holds, which one a request names, and when an old one may go.

A LoRA run (``spec.model.lora``) brings each policy version ``N`` to a server as an adapter named
``policy-vN-<token>`` (:func:`new_adapter_name`; version 0 is the base model, served under its own name), a
**name never used before**: vLLM 0.32 keeps the ``LoRARequest`` of a load, ``load_inplace`` flag included, and
hands it to every completion naming the adapter, and its worker reloads an adapter at each engine step while
that flag is set (``WorkerLoRAManager.add_adapter``: ``not loaded or lora_request.load_inplace``), from a
directory the trainer may replace or the follower remove meanwhile (issue 47: 40 reloads for 20 completions of
2 tokens; a deleted file killed the server). A fresh name needs no ``load_inplace``: the server reads the
directory once, at the load. Guarantees, for the one :class:`~rlrun.rollout.client.RolloutClient` that owns an
:class:`AdapterRegistry`:

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

import secrets
from collections import Counter

#: The name rlrun serves the base model under (``--served-model-name``): policy version 0, and every version of a
#: full-weights run.
SERVED_MODEL_NAME = "policy"


def new_adapter_name(version: int) -> str:
    """A name for policy ``version`` (≥ 1) no server was given before: ``policy-vN-`` and 8 random hex digits
    (one load in 4·10⁹ would repeat another load's name of the same version)."""
    return f"{SERVED_MODEL_NAME}-v{version}-{secrets.token_hex(4)}"


class AdapterRegistry:
    """The adapters one server holds (as far as its client knows) and the requests out naming each.

    Attributes:
        held: version → the directory its adapter was loaded from, for every adapter loaded and not yet unloaded.
        names: version → the name its adapter was loaded under (:func:`new_adapter_name`), for the same
        versions.
        out: adapter name → requests sent naming it and not yet answered (the base name counts too).
    """

    def __init__(self) -> None:
        self.held: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.out: Counter[str] = Counter()
        self._replaced: set[str] = set()  # names of a version loaded again under another, not yet unloaded

    @property
    def newest(self) -> int:
        """The newest version held (0: none, the base model)."""
        return max(self.held, default=0)

    def name(self) -> str:
        """The name a request sent now names: the newest adapter's, the base model's when none is held."""
        return self.names.get(self.newest, SERVED_MODEL_NAME)

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

    def loaded(self, version: int, path: str, name: str) -> list[str]:
        """Adapter ``version`` was loaded from ``path`` as ``name``; returns the adapters to unload now: older
        ones none names, and the name the version had before when it was loaded again (a catch-up) once none
        names it."""
        if (before := self.names.get(version)) not in (None, name):
            self._replaced.add(before)
        self.held[version], self.names[version] = path, name
        return self._releasable()

    def reset(self) -> None:
        """The server lost every adapter (it restarted): nothing is held; requests out stay counted, since they
        are still answered (with an error) and counted down."""
        self.held.clear()
        self.names.clear()
        self._replaced.clear()

    def _releasable(self) -> list[str]:
        newest = self.newest
        gone = [self.names[v] for v in sorted(self.held) if v < newest and not self.out.get(self.names[v])]
        for v in [v for v in self.held if self.names[v] in gone]:
            del self.held[v], self.names[v]
        replaced = sorted(n for n in self._replaced if not self.out.get(n))
        self._replaced.difference_update(replaced)
        return gone + replaced
