"""The build: everything is in pyproject.toml but the compiled modules (``tensora.native``).

Where a C compiler is at hand, mypyc (it ships with mypy, a build requirement pinned to the version the type check
uses) compiles the groups of modules of ``tensora.native.GROUPS``; where it is not, or ``TENSORA_PURE`` is set, or
the compile fails, Tensora installs as pure Python and says so. The build writes ``tensora/_native_build.json``:
the digest of each source compiled (``tensora.native.guard`` runs the source instead of a build that no longer
matches it), and for each group left pure, why (``tensora.native.why_pure`` says it).

The type check mypyc runs sees the same code on every machine, whatever is installed there. pip builds in an
isolated environment (only ``[build-system].requires``), but mypy finds packages through the target
environment's ``site.getsitepackages()``: a venv holding pydantic, SQLAlchemy and the rest (the test command
installs the lock first) type-checked with their types, and a fresh one (``pip install -e '.[local]'``, ``pip
wheel .``) saw them missing, so their classes became ``Any``, and ``strict``'s "Class cannot subclass "BaseModel"
(has type "Any")" refused both groups. So the build's check (``_check_args``):

- never looks at installed packages (``--no-site-packages``): every third-party name is ``Any``;
- reports errors only in the modules it compiles (``--follow-imports=silent``): Tensora's other modules are read
  for their types, not judged; the full check (``mypy``, run by the test command with every dependency) holds them;
- in the compiled modules, lets ``Any`` where only a dependency's missing types put it (``_ANY_FROM_DEPENDENCIES``):
  returning it, decorating with it. Every other rule of the project's config holds; subclassing a dependency's
  class is refused (no compiled class may).

``Any`` costs mypyc nothing where it matters: a third-party object is a Python object either way (an attribute or
call through the C API), and a value returned as ``Any`` into a declared type is checked once at the boundary.
Measured (2026-12-07, 2 shared cores): ``tensora plan`` of 5,000 workloads on 500 nodes over 90 minutes, this
build against the earlier one that saw the dependencies' types, six runs each alternated: the same bytes, min
1.49 s vs 1.52 s, median 2.06 vs 2.05 s (from source 4.6 s); ``pip install -e '.[local]'`` into a fresh venv,
downloads and both compiles, 4m46s-5m15s (tests/e2e/test_install_compiled.py).

Rejected: the typed dependencies in ``[build-system].requires`` (pydantic, SQLAlchemy, httpx, redis,
prometheus-client, orjson, fastapi, uvloop... the imports the compiled modules reach): every install downloads and
unpacks them once more for the build, pinned apart from the runtime's own ranges, and the target environment's
packages would still be on mypy's path, so the check would still vary with what is installed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
sys.path.insert(0, str(SRC))
from tensora import native  # noqa: E402  (the list of modules and the manifest's name live with the guard)

BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
"""Commands that build; the others (egg_info, dist_info, sdist) need no type check and no compile."""

_ANY_FROM_DEPENDENCIES = {
    "warn_return_any": False,
    "disallow_untyped_decorators": False,
    "disallow_any_unimported": False,
}
"""The rules relaxed in the compiled modules for the build's check only: each is broken only by a dependency's
types the build does not see (``return orjson.dumps(...)``). Not ``disallow_subclassing_any``: a compiled class
built on a dependency's class, ``Any`` here, compiles to an extension class that crashes the interpreter when
called (seen: ``GatewayCollector(prometheus_client.Collector)``), so the check refuses it and the group stays pure,
said by ``why_pure``."""


def _say(text: str) -> None:
    print(f"tensora build: {text}", file=sys.stderr)


def _manifest() -> Path:
    return SRC / "tensora" / native.MANIFEST


def _write_manifest(folder: Path, compiled: Iterable[str], pure: dict[str, str]) -> None:
    """``{"sources": {module: sha256}, "pure": {group: why}}``: what the build compiled and what it left pure."""
    record = {"sources": {m: native.digest(native.source(m)) for m in compiled}, "pure": pure}
    (folder / native.MANIFEST).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _why_not() -> str | None:
    if os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        return f"{native.PURE_ENV} was set at install"
    if not BUILDS.intersection(sys.argv[1:]):
        return "nothing to build"
    return native.no_compiler()


def _drop_builds(groups: Iterable[str] | None = None) -> None:
    """An earlier build's files in the source tree (an editable install's), of ``groups`` or all (also those of
    a group no longer listed: the package has no other native code), so a pure build leaves none behind."""
    if groups is None:
        _manifest().unlink(missing_ok=True)
        olds = [*SRC.glob("tensora/**/*.so"), *SRC.glob("*__mypyc.*")]
    else:
        olds = [*(p for g in groups for m in native.GROUPS[g] if (p := native.built(m)) is not None),
                *(p for g in groups for p in SRC.glob(f"{g}__mypyc.*"))]
    for old in olds:
        old.unlink()


@contextlib.contextmanager
def _check_config() -> Iterator[Path]:
    """The project's mypy config (``pyproject.toml``) with the compiled modules' ``_ANY_FROM_DEPENDENCIES``
    added, in a temporary file for the build's check (the project's own check stays as it is)."""
    modules = [m for group in native.GROUPS.values() for m in group]
    extra = "\n".join(f"{key} = {json.dumps(value)}" for key, value in _ANY_FROM_DEPENDENCIES.items())
    text = (HERE / "pyproject.toml").read_text()
    text += f"\n[[tool.mypy.overrides]]\nmodule = {json.dumps(modules)}\n{extra}\n"
    with tempfile.TemporaryDirectory(prefix="tensora-build-") as tmp:
        path = Path(tmp, "pyproject.toml")
        path.write_text(text)
        yield path


def _check_args(config: Path) -> list[str]:
    """mypy's options for the build's check: the same on every machine (this module's docstring says why)."""
    return ["--config-file", str(config), "--no-site-packages", "--ignore-missing-imports",
            "--follow-imports=silent", "--no-warn-unused-ignores"]


def _refusal(output: str, exc: BaseException) -> str:
    """mypyc's reason in one line: its first error and how many there were (all of them go to stderr)."""
    errors = [line for line in output.splitlines() if ": error:" in line]
    if not errors:
        return f"mypyc failed ({exc})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"mypyc refused it: {errors[0]}{more}"


def _ext_modules() -> list[Any]:
    why = _why_not()
    if why == "nothing to build":
        return []
    _drop_builds()  # the manifest is written again once the groups are type-checked and their C made
    if why is not None:
        _say(f"pure Python: {why}")
        _write_manifest(_manifest().parent, [], dict.fromkeys(native.GROUPS, why))
        return []
    from mypyc.build import mypycify

    exts: list[Any] = []
    compiled: list[str] = []
    pure: dict[str, str] = {}
    with _check_config() as config:
        for group, modules in native.GROUPS.items():
            paths = [str(native.source(m).relative_to(HERE)) for m in modules]
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):  # mypyc prints its errors, then exits
                    exts += mypycify([*_check_args(config), *paths], group_name=group, opt_level="3")
            except (Exception, SystemExit) as exc:
                print(out.getvalue(), file=sys.stderr, end="")
                pure[group] = _refusal(out.getvalue(), exc)
                _say(f"{group} stays pure Python: {pure[group]}")
                _drop_builds([group])
                continue
            print(out.getvalue(), file=sys.stderr, end="")
            compiled += modules
    _write_manifest(_manifest().parent, compiled, pure)
    return exts


class OptionalBuildExt(build_ext):
    """A compile that fails leaves a pure install that says why, never a half-built group (nor an older build's
    files)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            why = f"the C compile failed ({exc})"
            _say(f"pure Python: {why}")
            _drop_builds()
            folders = [_manifest().parent]
            if not self.inplace:  # a wheel's build: its copy of the package is in build_lib
                for ext in self.extensions:
                    Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
                folders.append(Path(self.build_lib, "tensora"))
            for folder in folders:
                if folder.is_dir():
                    _write_manifest(folder, [], dict.fromkeys(native.GROUPS, why))


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
