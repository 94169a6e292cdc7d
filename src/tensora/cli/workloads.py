"""``tensora workloads``: list, get, events, stop, restart, delete (by id or name)."""

from __future__ import annotations

from typing import Annotated

import typer

from tensora.cli.common import (
    Col,
    Output,
    app,
    check_output,
    emit,
    out,
    table,
)
from tensora.cli.root import (
    dump,
    local_time,
    placed,
    session,
    show,
)

LIST_FLAGS = {"kind": "--kind", "state": "--state"}


workloads_app = typer.Typer(help="List, inspect, stop, restart and delete workloads (by id or name).",
                            no_args_is_help=True)
app.add_typer(workloads_app, name="workloads", rich_help_panel="Use Tensora")
Ref = Annotated[str, typer.Argument(help="a workload id (wl_...) or name")]


@workloads_app.command("list")
def workloads_list(ctx: typer.Context, kind: Annotated[str | None, typer.Option(help="notebook, vm, endpoint")]
                   = None, state: Annotated[str | None, typer.Option(help="queued, running, ...")] = None,
                   output: Output = "table") -> None:
    """Your workloads, oldest first: where each asked to run, where it runs, and why."""
    check_output(output)
    with session(ctx, LIST_FLAGS) as c:
        rows = sorted(c.iter_workloads(kind, state), key=lambda w: w.created_at)
        admin = output == "table" and c.current_key().admin
    if output == "json":
        dump(rows)
        return
    owner = ["owner"] if admin else []  # an admin sees every owner's: whose each one is
    emit(table(["id", "name", *owner, "kind", "state", "requested", "placed", Col("reason", wrap=True)],
               [(w.id, w.name, *([w.owner] if admin else []), w.kind, w.state, w.requested_class, placed(w),
                 w.reason) for w in rows]))


@workloads_app.command("get")
def workloads_get(ctx: typer.Context, ref: Ref, output: Output = "table") -> None:
    """One workload: state, requested and placed class, reason, conditions, URL or replicas."""
    check_output(output)
    with session(ctx) as c:
        w = c.find_workload(ref)
    dump(w) if output == "json" else show(w)


@workloads_app.command("events")
def workloads_events(ctx: typer.Context, ref: Ref, output: Output = "table") -> None:
    """Each state change and placement, with its reason."""
    check_output(output)
    with session(ctx) as c:
        events = c.workload_events(c.find_workload(ref).id)
    if output == "json":
        dump(events)
        return
    emit(table(["at", "type", "change", Col("reason", wrap=True)],
               [(local_time(e.at), e.type, f"{e.from_state or '-'} -> {e.to_state}" if e.to_state else "",
                 e.reason + (f" ({e.count} times, last {local_time(e.last_at)})" if e.count > 1 and e.last_at else ""))
                for e in events]))


@workloads_app.command("stop")
def workloads_stop(ctx: typer.Context, ref: Ref, output: Output = "table") -> None:
    """Stop it (accounting stops with it); restart brings it back."""
    check_output(output)
    with session(ctx) as c:
        w = c.stop_workload(c.find_workload(ref).id)
    dump(w) if output == "json" else show(w)


@workloads_app.command("restart")
def workloads_restart(ctx: typer.Context, ref: Ref,
                      on_requested: Annotated[bool, typer.Option(
                          "--on-requested", help="only on the requested class (the 'restart on GPU' offer)")] = False,
                      output: Output = "table") -> None:
    """Stop and queue it again: on its class, then its fallback list."""
    check_output(output)
    with session(ctx) as c:
        w = c.restart_workload(c.find_workload(ref).id, "requested" if on_requested else "policy")
    dump(w) if output == "json" else show(w)


@workloads_app.command("delete")
def workloads_delete(ctx: typer.Context, ref: Ref) -> None:
    """Stop it and remove it from listings; a notebook's files go with it (its usage stays)."""
    with session(ctx) as c:
        w = c.find_workload(ref)
        c.delete_workload(w.id)
    out.print(f"deleted {w.name} ({w.id})", markup=False)
