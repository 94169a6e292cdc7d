"""``tensora catalog``: the classes, their free capacity, and the local catalog file checked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tensora.cli.common import (
    Col,
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
    session,
)
from tensora.errors import ConfigError
from tensora.units import format_memory


@app.command("catalog", rich_help_panel="Use Tensora")
def catalog_command(ctx: typer.Context, output: Output = "table",
                    catalog: Annotated[Path | None, typer.Option(
                        "--catalog", help="show this catalog file instead, offline")] = None) -> None:
    """The compute classes workloads can ask for (and fall back to), with free capacity."""
    from tensora.config.catalog import load_catalog

    check_output(output)
    if catalog is not None:
        try:
            cat = load_catalog(catalog)
        except ConfigError as exc:
            raise fail(exc) from None
        rows: list[dict[str, Any]] = [
            {"name": c.name, "kind": c.kind.value, "cpu": c.cpu, "memory": format_memory(c.memory),
             "gpu": {"model": c.gpu_model, "count": c.gpu_count, "memory": format_memory(c.gpu_memory)}
             if c.gpu_model else None, "capacity": {}} for c in cat.values()]
        note, region = "", None
    else:
        with session(ctx) as client:
            got = client.catalog()
        rows = [c.model_dump(mode="json") for c in got.data]
        note, region = got.note, got.region
    if output == "json":
        dump({"region": region, "data": rows, "note": note})
        return
    lines = []
    for c in rows:
        gpu = f"{c['gpu']['count']}x {c['gpu']['model']} {c['gpu']['memory']}" if c["gpu"] else "-"
        cap = c["capacity"].get(region or "", {})
        lines.append((c["name"], c["kind"], gpu, f"{c['cpu']:g}", c["memory"],
                      f"{cap['free']}/{cap['total']}" if cap else "-", c.get("short", {}).get(region or "", "")))
    emit(table(["name", "kind", "gpu", "vCPU", "memory", "free/total", Col("short", wrap=True)], lines))
    if note:
        out.print(note, markup=False)
