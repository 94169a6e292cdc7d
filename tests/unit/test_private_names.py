"""No package of ``tensora`` reaches into another's private names.

A leading underscore says "this package's own": a name another package may not import (``from tensora.X.y import
_z`` in a module outside ``tensora.X``) nor read off the module (``y._z``). Within a package, private names are
shared freely. The packages are ``tensora``'s subpackages; the modules directly under ``tensora`` (``clock``,
``units``, ...) form one package of their own, ``tensora``. The checker reads the source (``ast``), so it sees
imports under ``TYPE_CHECKING`` too; its table of named cases shows what it flags and what it lets pass."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import tensora

SRC = Path(tensora.__file__).resolve().parent
ROOT_PACKAGE = "tensora"


@dataclass(frozen=True, slots=True)
class Reach:
    """One use of another package's private name: where, and what (``module.name``)."""

    line: int
    name: str


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_of(module: str) -> str:
    """``tensora.X`` for a module of subpackage X (at any depth), ``tensora`` for one directly under it."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else ROOT_PACKAGE


def owner_of(module: str, modules: frozenset[str]) -> str:
    """The package a module belongs to: a subpackage's ``__init__`` belongs to that subpackage."""
    if module in modules and module != ROOT_PACKAGE and f"{module}.__init__" in modules:
        return package_of(module + ".x")
    return package_of(module)


def resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute module a ``from`` import names (``level`` dots, relative to ``importer``)."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def private_reaches(importer: str, source: str, modules: frozenset[str], is_package: bool = False) -> list[Reach]:
    """Every private name of another package that the module ``importer`` (its ``source``) imports or reads off a
    module. ``modules``: the tree's module names (a package's ``__init__`` as ``pkg.__init__``, and ``pkg``)."""
    mine = owner_of(importer, modules) if is_package else package_of(importer)
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # a local name -> the tensora module it is bound to
    out: list[Reach] = []

    def foreign(module: str) -> bool:
        return (module == ROOT_PACKAGE or module.startswith(ROOT_PACKAGE + ".")) and owner_of(module, modules) != mine

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            source_module = resolve(importer, is_package, node.level, node.module)
            for alias in node.names:
                full = f"{source_module}.{alias.name}"
                if full in modules:  # a module imported by name: bind it, and its own name may be private
                    bound[alias.asname or alias.name] = full
                if is_private(alias.name) and foreign(source_module):
                    out.append(Reach(node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain = dotted(node.value)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            if head not in bound:
                continue
            module = f"{bound[head]}.{rest}" if rest else bound[head]
            if module in modules and foreign(module):
                out.append(Reach(node.lineno, f"{module}.{node.attr}"))
    return sorted(out, key=lambda r: (r.line, r.name))


# -- the checker, on named cases --------------------------------------------------------------------------------

MODULES = frozenset({
    "tensora", "tensora.__init__", "tensora.clock",
    "tensora.placement", "tensora.placement.__init__", "tensora.placement.admission", "tensora.placement.capacity",
    "tensora.gateway", "tensora.gateway.__init__", "tensora.gateway.proxy", "tensora.gateway.chain",
})


@dataclass(frozen=True)
class Case:
    importer: str
    source: str
    want: list[str]  # the names flagged
    is_package: bool = False


CASES = {
    "another package's private name, imported -> flagged": Case(
        "tensora.gateway.proxy", "from tensora.placement.admission import _alike, decide\n",
        ["tensora.placement.admission._alike"]),
    "its own package's private name -> passes": Case(
        "tensora.placement.capacity", "from tensora.placement.admission import _alike\n", []),
    "a relative import inside its package -> passes": Case(
        "tensora.placement.capacity", "from .admission import _alike\n", []),
    "a relative import into another package -> flagged": Case(
        "tensora.gateway.proxy", "from ..placement.admission import _alike\n", ["tensora.placement.admission._alike"]),
    "a package's __init__ importing its own module's private name -> passes": Case(
        "tensora.placement", "from .admission import _alike\n", [], is_package=True),
    "another package's private attribute, read off the module -> flagged": Case(
        "tensora.gateway.proxy", "from tensora.placement import admission\nadmission._alike([])\n",
        ["tensora.placement.admission._alike"]),
    "through import ... as -> flagged": Case(
        "tensora.gateway.proxy", "import tensora.placement.admission as adm\nx = adm._REMEMBER\n",
        ["tensora.placement.admission._REMEMBER"]),
    "through the dotted module name -> flagged": Case(
        "tensora.gateway.proxy", "import tensora.placement.admission\ntensora.placement.admission._alike([])\n",
        ["tensora.placement.admission._alike"]),
    "under TYPE_CHECKING too -> flagged": Case(
        "tensora.gateway.proxy",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tensora.placement.capacity import _Row\n",
        ["tensora.placement.capacity._Row"]),
    "a module directly under tensora is another package -> flagged": Case(
        "tensora.gateway.chain", "from tensora.clock import _now\n", ["tensora.clock._now"]),
    "a module of the tensora package reading its neighbour -> passes": Case(
        "tensora.clock", "from tensora import native\nnative._ROOT\n", []),
    "a dunder is public -> passes": Case(
        "tensora.gateway.proxy", "from tensora.placement.admission import __all__\n", []),
    "a public name -> passes": Case(
        "tensora.gateway.proxy", "from tensora.placement.admission import decide\n", []),
    "a private attribute of an object, not of a module -> passes": Case(
        "tensora.gateway.proxy", "from tensora.placement.admission import decide\nself._x = decide._cache\n", []),
    "another library's private name -> passes": Case(
        "tensora.gateway.proxy", "import os\nos._exit(1)\nfrom collections import _chain\n", []),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_checker(case: Case) -> None:
    got = private_reaches(case.importer, case.source, MODULES, case.is_package)
    assert [r.name for r in got] == case.want


# -- the tree ------------------------------------------------------------------------------------------------------

def tree_modules() -> dict[str, Path]:
    """Every module of the tree by name; a package by its own name (its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = [ROOT_PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def test_no_package_reaches_into_another_packages_private_names() -> None:
    found = tree_modules()
    assert len(found) > 50, "the tree's modules were not found"
    names = frozenset(found) | {f"{m}.__init__" for m, p in found.items() if p.name == "__init__.py"}
    reaches = {m: r for m, p in found.items()
               if (r := private_reaches(m, p.read_text(), names, p.name == "__init__.py"))}
    assert reaches == {}
