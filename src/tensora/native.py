"""Tensora's compiled modules, and the guard that never lets a stale build run.

Admission's hot path is compiled by mypyc (it ships with mypy) when Tensora is installed on a machine with a C
compiler (``setup.py``): the same source, typed as it is, runs faster as C extensions (figures: docs/benchmarks.md;
ADR-0021). The ``.py`` files stay the source of truth and are what runs where nothing was compiled. At the top of
the package: ``setup.py`` imports it before the package is built, and ``import tensora`` runs its guard first.

A compiled module sits next to its source (an editable install builds in place), and Python imports the extension
before the source: after an edit, or a checkout of other code, the old build would run instead of the new code. So
the build writes the digest of each source it compiled (:data:`MANIFEST`), and :func:`guard` (run by ``import
tensora``) makes the whole group load from source when any of them changed since, or when ``TENSORA_PURE`` is
set. A group is all or nothing: its modules call each other natively, so one stale module cannot be swapped alone.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

ADMISSION = "tensora_admission"
GATEWAY = "tensora_gateway"

GROUPS: dict[str, tuple[str, ...]] = {
    ADMISSION: (
        "tensora.placement.kinds",
        "tensora.placement.catalog",
        "tensora.placement.capacity",
        "tensora.placement.decisions",
        "tensora.placement.policy",
        "tensora.placement.owner_quotas",
        "tensora.placement.attempts",
        "tensora.placement.recount",
        "tensora.placement.admission",
        "tensora.placement.admission_events",
        "tensora.placement.timers",
        "tensora.placement.standing",
        "tensora.placement.priority_lists",
        "tensora.placement.cycle_proof",
        "tensora.placement.kept_records",
        "tensora.placement.admission_state",
        "tensora.control.ledger",
        "tensora.control.apply",
        "tensora.control.reconcile",
        "tensora.control.snapshot",
        "tensora.control.replay",
    ),
    GATEWAY: (
        "tensora.gateway.routes",
        "tensora.gateway.breaker",
        "tensora.gateway.chain",
        "tensora.gateway.body",
        "tensora.gateway.upstream",
        "tensora.gateway.sse",
        "tensora.gateway.call",
        "tensora.gateway.relay",
        "tensora.gateway.walk",
        "tensora.gateway.limits",
        "tensora.gateway.metrics",
        "tensora.gateway.records",
        "tensora.gateway.idempotency",
        "tensora.gateway.proxy",
        "tensora.gateway.server",
    ),
}
"""The modules compiled, by group: each group is one shared library (``<group>__mypyc``) whose modules call each
other natively. Each module is typed, and no test patches one of its functions (a compiled call does not look
the name up). The gateway's group is its request path (left out: ``routedoc``, TypedDicts only; ``metering``, whose
tests replace a Meter's methods, off the request path: the request path queues its records in ``records``;
``app`` and ``probe``, start-up and background work). Its coroutines await nothing inside an ``except`` or
``finally`` and ``async with`` only ``asyncio.timeout`` (``tests/unit/test_gateway_compiled_rules.py``): compiled,
the end of such a block raises again whatever exception the thread holds, which after an ``await`` may be another
request's."""

MANIFEST = "_native_build.json"
"""Written by the build next to this file: ``{"sources": {module: sha256 of its source}, "pure": {group: why}}``:
what it compiled, and why it left each other group pure (no compiler, ``TENSORA_PURE``, mypyc's refusal, a failed
C compile)."""

PURE_ENV = "TENSORA_PURE"
"""Set (to anything but empty or ``0``) to run the pure Python modules although a build is there."""

_ROOT = Path(__file__).resolve().parent.parent  # the folder holding the tensora package


class NativeStaleWarning(UserWarning):
    """A compiled build is there but older than its source: the source runs (slower) until it is rebuilt."""


def source(module: str) -> Path:
    return _ROOT.joinpath(*module.split(".")).with_suffix(".py")


def built(module: str) -> Path | None:
    """The module's compiled extension next to its source, if there is one."""
    src = source(module)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = src.with_suffix(suffix)
        if path.exists():
            return path
    return None


def digest(path: Path) -> str:
    import hashlib  # only where a build is there: the pure install never pays for it

    return hashlib.sha256(path.read_bytes()).hexdigest()


def no_compiler() -> str | None:
    """What this machine lacks to compile the group (``None``: nothing)."""
    import shutil
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        return "no Python headers (Python.h)"
    return None


def _record() -> dict[str, object] | None:
    """The build's manifest (:data:`MANIFEST`), ``None`` where it is missing or not a JSON object."""
    try:
        record = json.loads((_ROOT / "tensora" / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def why_pure(group: str = ADMISSION) -> str | None:
    """Why ``group`` runs from source (``None``: it runs compiled)."""
    modules = GROUPS[group]
    record = _record()
    if not any(built(m) for m in modules):
        if record is None:
            return "not compiled (no record of a build: a source tree never installed, or an older Tensora's)"
        said = record.get("pure")
        why = said.get(group) if isinstance(said, dict) else None
        if isinstance(why, str):
            return f"not compiled at install: {why}"
        return "not compiled (the build compiled it, but its extension files are gone)"
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV} is set"
    sources = record.get("sources") if record is not None else None
    if not isinstance(sources, dict):
        return f"the build's manifest ({MANIFEST}) is missing or unreadable"
    for module in modules:
        if built(module) is None:
            return f"{module} was not compiled"
        if sources.get(module) != digest(source(module)):
            return f"{source(module)} changed since it was compiled (pip install -e . compiles it again)"
    return None


class _FromSource:
    """Finds a group's modules, once the first of them is imported: from source when :func:`why_pure` says so,
    else leaves them to the usual finders (which take the extension). A meta path finder by its ``find_spec``
    alone: importing ``importlib.abc`` would slow the start of every command."""

    def __init__(self) -> None:
        self.group = {m: group for group, modules in GROUPS.items() for m in modules}
        self.reasons: dict[str, str | None] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> ModuleSpec | None:
        group = self.group.get(fullname)
        if group is None:
            return None
        if group not in self.reasons:
            reason = self.reasons[group] = why_pure(group)
            if reason is not None and not reason.startswith(("not compiled", PURE_ENV)):
                warnings.warn(f"tensora: {group} runs from source, slower: {reason}", NativeStaleWarning,
                              stacklevel=2)
        if self.reasons[group] is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source(fullname))


_finder = _FromSource()


def guard() -> None:
    """Put the finder first on ``sys.meta_path`` (once). Costs a set lookup per import until a compiled module
    is asked for; then one check of the sources' digests."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def compiled(group: str = ADMISSION) -> bool:
    """Whether ``group`` runs compiled in this process (imports its first module if it is not yet)."""
    module = importlib.import_module(GROUPS[group][0])
    return not str(module.__file__).endswith(".py")
