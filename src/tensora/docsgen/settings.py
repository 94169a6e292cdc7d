"""The configuration reference: every setting of ``tensora serve`` (and ``tensora up``) and of the gateway, from
their pydantic models, with its type, bounds, default and description. Nested models are spelled out under their
dotted keys (``quotas.keys``, ``gateway.peers[].url``), as a config file writes them."""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tensora.docsgen import markdown as md


def type_name(annotation: Any) -> str:
    """An annotation as a reader of a config file needs it: ``int``, ``path or null``, ``one of a, b``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field: FieldInfo) -> str:
    """The field's numeric bounds, e.g. ``>= 0, <= 65535``."""
    said = []
    for m in field.metadata:
        for kind, op in ((Ge, ">="), (Gt, ">"), (Le, "<="), (Lt, "<")):
            if isinstance(m, kind):
                said.append(f"{op} {getattr(m, kind.__name__.lower())}")
    return ", ".join(said)


def default(field: FieldInfo) -> str:
    """The default as YAML writes it; a computed one by its factory's docstring."""
    if field.default_factory is not None:
        factory: Any = field.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return "(below)"
        if factory in (dict, list):
            return md.code("{}" if factory is dict else "[]")
        return md.cell((factory.__doc__ or factory.__name__).strip().splitlines()[0])
    value = field.default
    if value is PydanticUndefined:
        return "(required)"
    return md.code(_yaml(value))


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def _model_of(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field holds (itself, optional, or a list's items), and the key's suffix for a list."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a, ""
        if typing.get_origin(a) is list:
            item = typing.get_args(a)[0]
            if isinstance(item, type) and issubclass(item, BaseModel):
                return item, "[]"
    return None


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[list[str]]:
    """One row per setting, nested models' settings after their own row."""
    for name, field in model.model_fields.items():
        key = prefix + name
        kind = type_name(field.annotation)
        limit = bounds(field)
        yield [md.code(key), md.cell(kind + (f" ({limit})" if limit else "")), default(field),
               md.cell(field.description or "")]
        nested = _model_of(field.annotation)
        if nested is not None:
            yield from rows(nested[0], f"{key}{nested[1]}.")


def render() -> str:
    from tensora.config.settings import ServeSettings
    from tensora.gateway.app import GatewaySettings

    head = ["Key", "Type", "Default", "Description"]
    return "\n".join([
        "# Configuration reference\n", md.HEADER,
        "Settings come from their defaults, then a YAML config file (`--config`), then environment variables, then "
        "flags, each over the one before. A bad value is refused with the file and line, variable or flag it came "
        "from.\n",
        "## tensora serve and tensora up\n",
        "Top-level keys of the config file. Each top-level key `NAME` is also read from the environment variable "
        "`TENSORA_NAME` (upper case), e.g. `TENSORA_PORT=8800`.\n",
        md.table(head, rows(ServeSettings)),
        "## The gateway\n",
        "Keys of the config file's `gateway:` section (`tensora gateway --config`, and `tensora up`). Each top-level "
        "key `NAME` is also read from `TENSORA_GATEWAY_NAME`, e.g. `TENSORA_GATEWAY_REDIS_URL`.\n",
        md.table(head, rows(GatewaySettings, "gateway.")),
    ])
