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

from tensora.config.wording import in_words
from tensora.errors import ConfigError

E = TypeVar("E", bound=ConfigError)
PathKey = tuple[str | int, ...]


class Lines:
    """Path of a value in the document -> the line it starts on (found when first asked: only an error needs
    one, and finding them costs more than reading a large file)."""

    def __init__(self, lines: dict[PathKey, int] | Callable[[], dict[PathKey, int]]) -> None:
        self._lines = lines if isinstance(lines, dict) else None
        self._find = lines if callable(lines) else None

    def exact(self, path: PathKey) -> int | None:
        """The line of ``path`` itself; None when the document has no such key."""
        if self._lines is None:
            assert self._find is not None
            self._lines = self._find()
        return self._lines.get(tuple(path))

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
        return _read_plain(text), Lines(lambda: _load_nodes(text, source, error)[1])
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
    """A document :func:`_read_plain` does not read as :func:`_construct` does."""


class _Parser(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """The safe loader's parser, resolver and scalar constructors: libyaml's parser where it is built in."""


_NO_KEY = object()  # a mapping being read waits for its next key
_UNSEEN = object()  # a plain scalar not resolved yet


def _read_plain(text: str) -> Any:
    """The data of a plain document as the safe loader builds it, from the parser's events: no node tree, and
    a scalar resolved once per distinct text (with libyaml's parser, a 10,000-workload plan file in a fifth of
    a second; the safe loader took four times that, the pure-Python one a minute). It refuses
    (:class:`_NotPlain`) what :func:`_construct` reads differently or reports, which is then read node by
    node: a key that is not a plain name or appears twice, a merge key, a tag, an anchor twice, an undefined
    alias, several documents."""
    parser = _Parser(text)
    try:
        parser.get_event()  # the stream's start
        if parser.check_event(yaml.StreamEndEvent):
            return None
        parser.get_event()  # the document's start
        data = _build(parser)
        parser.get_event()  # the document's end
        if not parser.check_event(yaml.StreamEndEvent):
            raise _NotPlain  # another document: composing says why
        return data
    finally:
        parser.dispose()


def _build(parser: _Parser) -> Any:
    """The document's value, from its events: the containers open, each mapping with the key it waits on.
    A plain scalar is resolved once per distinct text; a quoted one is its text. An alias is its anchor's
    value, the same object, as the safe loader makes it."""
    plain: dict[str, Any] = {}
    anchors: dict[str, Any] = {}
    open_: list[dict[str, Any] | list[Any]] = []
    keys: list[Any] = []  # a mapping's key to come (_NO_KEY) or to set; None for a list
    next_event = parser.get_event
    scalar, mapping, sequence = yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent
    while True:
        event = next_event()
        kind = type(event)
        if kind is scalar:
            if event.tag is not None:
                raise _NotPlain
            value = event.value
            if event.implicit[0]:
                value = plain.get(value, _UNSEEN)
                if value is _UNSEEN:
                    value = plain[event.value] = _scalar(parser, event)
            if event.anchor is not None:
                _anchor(anchors, event.anchor, value)
        elif kind is mapping or kind is sequence:
            if event.tag is not None or (keys and keys[-1] is _NO_KEY):  # a tag, or a key that is not a name
                raise _NotPlain
            open_.append({} if kind is mapping else [])
            keys.append(_NO_KEY if kind is mapping else None)
            if event.anchor is not None:
                _anchor(anchors, event.anchor, open_[-1])
            continue
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            value = open_.pop()
            keys.pop()
        else:  # an alias
            value = anchors.get(event.anchor, _UNSEEN)
            if value is _UNSEEN:
                raise _NotPlain  # composing says why
        if not open_:
            return value
        top, key = open_[-1], keys[-1]
        if isinstance(top, list):
            top.append(value)
        elif key is _NO_KEY:
            if type(value) is not str or value in top:  # not a plain name (a number, a merge key), or twice
                raise _NotPlain
            keys[-1] = value
        else:
            top[key] = value
            keys[-1] = _NO_KEY


def _anchor(anchors: dict[str, Any], anchor: str, value: Any) -> None:
    if anchor in anchors:
        raise _NotPlain  # an anchor twice: composing says why
    anchors[anchor] = value


def _scalar(parser: _Parser, event: yaml.ScalarEvent) -> Any:
    """A plain scalar as the safe loader builds it: the tag its resolver gives, then that tag's constructor."""
    tag = parser.resolve(yaml.ScalarNode, event.value, event.implicit)
    return parser.construct_object(yaml.ScalarNode(tag, event.value))


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
    if path and isinstance(path[-1], str) and path[-1].endswith("_s") and lines.exact(path) is None:
        given = (*path[:-1], path[-1].removesuffix("_s"))  # a duration given as text (fallback_after: 10m)
        if lines.exact(given) is not None:
            path = given
    message = in_words(first)
    context = describe(path) if describe else ""
    if context:
        message = f"{message} ({context})"
    return error(message, source=source, line=lines.line(path), field=_dotted(path))
