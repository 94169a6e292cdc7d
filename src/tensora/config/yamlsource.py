"""YAML with line numbers, so that an error in a file a person wrote names file, line and field.

``load(path)`` returns the plain data and a :class:`Lines` map from a value's path
(``("classes", 3, "gpu", "count")``) to its 1-based line. :func:`validation_error`
turns a pydantic ``ValidationError`` into the caller's ConfigError subclass, naming
the first problem's field and line. YAML and pydantic exceptions stop here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from yaml.constructor import SafeConstructor

from tensora.errors import ConfigError

E = TypeVar("E", bound=ConfigError)
PathKey = tuple[str | int, ...]


class Lines:
    """Path of a value in the document -> the line it starts on (found when first asked: only an error needs
    one, and finding them costs more than reading a large file)."""

    def __init__(self, lines: dict[PathKey, int] | Callable[[], dict[PathKey, int]]) -> None:
        self._lines = lines if isinstance(lines, dict) else None
        self._find = lines if callable(lines) else None

    def line(self, path: PathKey) -> int | None:
        """The line of ``path`` or of its nearest ancestor that has one."""
        if self._lines is None:
            assert self._find is not None
            self._lines = self._find()
        for end in range(len(path), -1, -1):
            found = self._lines.get(tuple(path[:end]))
            if found is not None:
                return found
        return None


def _construct(node: yaml.Node, path: PathKey, lines: dict[PathKey, int], source: str, error: type[E],
               scalars: SafeConstructor) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                raise error("keys must be plain names", source=source, line=key_node.start_mark.line + 1)
            if key in out:
                raise error(
                    f"key {key!r} appears twice", source=source, line=key_node.start_mark.line + 1,
                    field=_dotted((*path, key)),
                )
            out[key] = _construct(value_node, (*path, key), lines, source, error, scalars)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, (*path, i), lines, source, error, scalars) for i, item in enumerate(node.value)]
    # Scalars: the tag the composer resolved (int, float, bool, null, str), built as the safe loader builds it.
    return scalars.construct_object(node)


def load_text(text: str, source: str, error: type[E]) -> tuple[Any, Lines]:
    """Parse YAML text; ``source`` names it in errors (a path or ``<default catalog>``)."""
    try:
        return yaml.load(text, Loader=_PlainLoader), Lines(lambda: _load_nodes(text, source, error)[1])
    except (yaml.YAMLError, _NotPlain):
        data, lines = _load_nodes(text, source, error)
        return data, Lines(lines)


def _load_nodes(text: str, source: str, error: type[E]) -> tuple[Any, dict[PathKey, int]]:
    """The data and each value's line, from the node tree: the errors name the line of the problem."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise error(f"not valid YAML: {problem}", source=source, line=mark.line + 1 if mark else None) from None
    lines: dict[PathKey, int] = {}
    if node is None:
        return None, lines
    return _construct(node, (), lines, source, error, SafeConstructor()), lines


class _NotPlain(Exception):
    """A document :class:`_PlainLoader` does not read as :func:`_construct` does."""


_STR, _MAP, _SEQ = "tag:yaml.org,2002:str", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


class _PlainLoader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """The safe loader (libyaml's where it is built in: a 100,000-workload plan file in a second, not a
    minute), refusing what :func:`_construct` reads differently or reports: a key that is not a plain name
    or appears twice, a merge key, a tagged mapping or list. What it refuses is read node by node."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return super().construct_object(node, deep)
        if node.tag != (_MAP if isinstance(node, yaml.MappingNode) else _SEQ):
            raise _NotPlain
        if isinstance(node, yaml.MappingNode):
            keys = set()
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag != _STR or key.value in keys:
                    raise _NotPlain
                keys.add(key.value)
        return super().construct_object(node, deep)


def load(path: Path, error: type[E]) -> tuple[Any, Lines]:
    """Read and parse a YAML file; a missing or unreadable file is a ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read file: {exc.strerror or exc}", source=str(path)) from None
    except UnicodeDecodeError:
        raise error("not a UTF-8 text file", source=str(path)) from None
    return load_text(text, str(path), error)


def _dotted(path: PathKey) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(
    exc: ValidationError, *, source: str, lines: Lines, error: type[E], prefix: PathKey = (),
    describe: Callable[[PathKey], str] | None = None,
) -> E:
    """The first problem of a pydantic error, as ``error`` naming source, line and field."""
    first = exc.errors()[0]
    loc: PathKey = tuple(p for p in first["loc"] if isinstance(p, str | int))
    # pydantic adds the tagged-union tag or validator names to loc; keep real data keys only.
    path = (*prefix, *loc)
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif first["type"] == "missing":
        message = "field required"
    context = describe(path) if describe else ""
    if context:
        message = f"{message} ({context})"
    return error(message, source=source, line=lines.line(path), field=_dotted(path))
