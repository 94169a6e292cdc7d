"""``tensora usage``: accounted time by class, owner, kind and day."""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated

import typer

from tensora.cli.common import (
    Output,
    app,
    check_output,
    emit,
    fail,
    out,
    table,
)
from tensora.cli.root import (
    dump,
    local_time,
    session,
)
from tensora.units import parse_duration

USAGE_FLAGS = {"group_by": "--group-by", "since": "--since", "until": "--since", "owner": "--owner"}


def _since(value: str | None) -> float | None:
    """``24h``/``7d`` ago, or an ISO date or time."""
    if value is None:
        return None
    try:
        return time.time() - parse_duration(value)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise fail(f"--since {value!r}: give a duration (24h, 7d) or an ISO date (2027-01-15)") from None
    return (when if when.tzinfo else when.astimezone()).timestamp()


@app.command("usage", rich_help_panel="Use Tensora")
def usage_command(ctx: typer.Context,
                  group_by: Annotated[str, typer.Option(help="placed_class, owner, day, kind; comma-separated")]
                  = "placed_class",
                  since: Annotated[str | None, typer.Option(help="24h, 7d, or a date")] = None,
                  owner: Annotated[str | None, typer.Option(help="another owner's (admin keys)")] = None,
                  tokens: Annotated[bool, typer.Option("--tokens", help="tokens the gateway served instead")]
                  = False,
                  output: Output = "table") -> None:
    """Accounted time by the class that really ran it (no prices: Tensora is free), or tokens."""
    check_output(output)
    start = _since(since)
    with session(ctx, USAGE_FLAGS) as c:
        if tokens:
            t = c.token_usage(since=start)
            admin = output == "table" and c.current_key().admin
        else:
            u = c.usage([g.strip() for g in group_by.split(",") if g.strip()], since=start, owner=owner)
    if tokens:
        if output == "json":
            dump(t)
            return
        columns = [*(["owner"] if admin else []), "endpoint", "product", "model", "served_by", "requests",
                   "prompt_tokens", "completion_tokens"]
        rows = [[str(getattr(r, k)) for k in columns] for r in t.data]
    else:
        if output == "json":
            dump(u)
            return
        columns = [*u.group_by, "hours", "seconds"]
        rows = [[str(getattr(r, k) or "-") for k in u.group_by] + [f"{r.hours:.3f}", f"{r.seconds:.0f}"]
                for r in u.data]
    emit(table(columns, rows))
    if not tokens:
        first = "the start" if u.since.startswith("1970-01-01T00:00:00") else local_time(u.since)
        out.print(f"total {u.total_seconds / 3600:.3f} h from {first} to {local_time(u.until)}")
