"""``tensora owners``: owners' flags, quotas and gateway limits (admin keys set them)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from tensora.cli.common import (
    Output,
    app,
    check_output,
    emit,
    fail,
    fields,
    table,
)
from tensora.cli.root import (
    dump,
    local_time,
    session,
)
from tensora.config.quotas import Limits, Quotas
from tensora.units import format_memory, parse_memory

OWNER_FLAGS = {"owner": "OWNER", "trusted": "--trusted/--untrusted", "quotas": "--quota", "limits": "--limit",
               **{f"quotas.{n}": f"--quota {n}" for n in Quotas.model_fields},
               **{f"limits.{n}": f"--limit {n}" for n in Limits.model_fields}}


owners_app = typer.Typer(help="Owners' flags, quotas and gateway limits (set by admin keys; each owner reads its "
                              "own): every owner's pods run under Kata on Kubernetes unless it is marked trusted.",
                         no_args_is_help=True)
app.add_typer(owners_app, name="owners", rich_help_panel="Use Tensora")


def _amount(name: str, value: float) -> str:
    if name == "storage_bytes":
        return format_memory(int(value))
    return str(int(value)) if float(value).is_integer() else str(value)


def _print_owners(owners: list[Any], output: str, *, one: bool = True) -> None:
    if output == "json":
        dump(owners[0] if one else owners)
        return
    if not one:
        emit(table(["owner", "trusted", "overridden", "updated"],
                   [(o.owner, "yes" if o.trusted else "no", ", ".join(o.overridden) or "-",
                     local_time(o.updated_at) if o.updated_at else "-") for o in owners]))
        return
    o = owners[0]
    emit(fields([("owner", o.owner), ("trusted", "yes" if o.trusted else "no"),
                 ("updated", local_time(o.updated_at) if o.updated_at else "-")]))
    held = o.in_use.model_dump()
    rows = [(f"quotas.{n}", _amount(n, v), _amount(n, held[n]) if n in held else "-")
            for n, v in o.quotas.model_dump().items()]
    rows += [(f"limits.{n}", _amount(n, v), "-") for n, v in o.limits.model_dump().items()]
    emit(table(["setting", "value", "in use", "from"],
               [(*r, "set for this owner" if r[0] in o.overridden else "server default") for r in rows]))


def _settings(items: list[str] | None, flag: str, model: type[Quotas] | type[Limits]) -> dict[str, Any] | None:
    """``NAME=VALUE`` items as a PUT's partial dict: ``default`` is null (back to the server's default), a
    storage size may be written 50Gi; the server checks the bounds (and names the flag if one is out)."""
    if not items:
        return None
    got: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in model.model_fields:
            raise fail(f"{flag} {item!r}: expected NAME=VALUE (or NAME=default), NAME one of "
                       f"{', '.join(model.model_fields)}")
        try:
            got[name] = (None if raw == "default" else parse_memory(raw) if name == "storage_bytes"
                         else json.loads(raw))
        except ValueError:
            raise fail(f"{flag} {item!r}: {raw!r} is not a number") from None
    return got


@owners_app.command("list")
def owners_list(ctx: typer.Context, output: Output = "table") -> None:
    """The owners that an admin has set something on."""
    check_output(output)
    with session(ctx) as c:
        owners = c.list_owners()
    _print_owners(owners, output, one=False)


@owners_app.command("get")
def owners_get(ctx: typer.Context, owner: Annotated[str, typer.Argument(help="the owner")],
               output: Output = "table") -> None:
    """One owner's flags, quotas and limits (effective: the server's defaults where no admin set one) and what
    it holds now. Your own, or anyone's with an admin key."""
    check_output(output)
    with session(ctx, OWNER_FLAGS) as c:
        _print_owners([c.get_owner(owner)], output)


@owners_app.command("set")
def owners_set(ctx: typer.Context, owner: Annotated[str, typer.Argument(help="the owner")],
               trusted: Annotated[bool | None, typer.Option(
                   "--trusted/--untrusted", help="--trusted: its new notebook and endpoint pods run without Kata; "
                   "--untrusted: under Kata again, as every owner's do by default")] = None,
               quota: Annotated[list[str] | None, typer.Option(
                   "--quota", help="NAME=VALUE, repeatable: keys, workloads, running_gpus, running_cpu, "
                   "storage_bytes (e.g. 50Gi); NAME=default: back to the server's default")] = None,
               limit: Annotated[list[str] | None, typer.Option(
                   "--limit", help="NAME=VALUE, repeatable: requests_per_minute, tokens_per_minute (the gateway's, "
                   "across all the owner's keys), creates_per_minute, deletes_per_minute, uploads_per_minute (the "
                   "control API's); NAME=default: back to the server's default")] = None,
               output: Output = "table") -> None:
    """Set an owner's flag, quotas and limits (admin keys); what is not named keeps its value. Trust applies to
    replicas started from now on; a lower quota refuses new creates past it and removes nothing."""
    check_output(output)
    quotas, limits = _settings(quota, "--quota", Quotas), _settings(limit, "--limit", Limits)
    if trusted is None and quotas is None and limits is None:
        raise fail("nothing to set: give --trusted/--untrusted, --quota or --limit")
    with session(ctx, OWNER_FLAGS) as c:
        _print_owners([c.set_owner(owner, trusted=trusted, quotas=quotas, limits=limits)], output)
