"""The build: everything is in pyproject.toml but the compiled modules (``tensora.native``).

Where a C compiler is at hand, mypyc (it ships with mypy, a build requirement pinned to the version the type check
uses) compiles the groups of modules of ``tensora.native.GROUPS``; where it is not, or ``TENSORA_PURE`` is set, or
the compile fails, Tensora installs as pure Python and says so. The digest of each source compiled is
written to ``tensora/_native_build.json``: ``tensora.native.guard`` runs the source instead of a build that no
longer matches it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
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


def _say(text: str) -> None:
    print(f"tensora build: {text}", file=sys.stderr)


def _manifest() -> Path:
    return SRC / "tensora" / native.MANIFEST


def _why_not() -> str | None:
    if os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        return f"{native.PURE_ENV} is set"
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


def _ext_modules() -> list[Any]:
    why = _why_not()
    if why == "nothing to build":
        return []
    _drop_builds()  # the manifest is written again once the groups are type-checked and their C made
    if why is not None:
        _say(f"pure Python: {why}")
        return []
    from mypyc.build import mypycify

    exts: list[Any] = []
    compiled: list[str] = []
    for group, modules in native.GROUPS.items():
        paths = [str(native.source(m).relative_to(HERE)) for m in modules]
        try:
            # type-checked where the runtime's libraries are not installed (an isolated build): their types are
            # Any (so an ignore the full check needs may be unused here)
            exts += mypycify(["--config-file", "pyproject.toml", "--ignore-missing-imports",
                              "--no-warn-unused-ignores", *paths], group_name=group, opt_level="3")
        except (Exception, SystemExit) as exc:  # mypyc exits on a type error
            _say(f"{group} stays pure Python: mypyc refused it ({exc})")
            _drop_builds([group])
            continue
        compiled += modules
    _manifest().write_text(json.dumps({"sources": {m: native.digest(native.source(m)) for m in compiled}},
                                      indent=1, sort_keys=True) + "\n")
    return exts


class OptionalBuildExt(build_ext):
    """A compile that fails leaves a pure install, never a half-built group (nor an older build's files)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            _say(f"pure Python: the compile failed ({exc})")
            _drop_builds()


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
