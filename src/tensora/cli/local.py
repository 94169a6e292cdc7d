"""The commands that run Tensora on this machine or work offline: up, serve, gateway, node,
runtime, plan, model-size, dev. They parse arguments, call the library and print; each imports the library
it calls, so that a command (and ``--help``) loads only its own."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from tensora.cli.common import Col, Output, app, emit, json_text, out, table
from tensora.cli.common import check_output as _check_output
from tensora.cli.common import fail as _fail
from tensora.errors import ConfigError, ModelFileError, StoreUnavailable, TensoraError
from tensora.models.validator import check_cpu, read_model
from tensora.units import format_memory, parse_duration

CatalogFile = Annotated[Path | None, typer.Option("--catalog", help="operator catalog overriding the default")]


@app.command("plan", rich_help_panel="Run Tensora")
def plan_command(
    nodes: Annotated[Path, typer.Option(help="nodes.yaml of the simulated fleet")],
    workloads: Annotated[Path, typer.Option(help="workloads.yaml: create bodies + submitted_at/stop_at")],
    at: Annotated[str, typer.Option(help="the moment to report, as an offset: 0s, 90s, 10m")] = "0s",
    output: Output = "table",
    catalog: CatalogFile = None,
) -> None:
    """Capacity planning: where each workload is placed at --at on the simulated fleet, and why."""
    from tensora.config.catalog import load_catalog
    from tensora.control.fleet import load_nodes, load_workloads, plan

    _check_output(output)
    try:
        moment = parse_duration(at)
    except ValueError as exc:
        raise _fail(ValueError(f"--at: {exc}")) from None
    try:
        cat = load_catalog(catalog)
        fleet = load_nodes(nodes), load_workloads(workloads, cat)
        gc.freeze()  # the fleet (and every module) lives as long as the command: the replay's collections skip it
        rows = plan(*fleet, cat, moment)
    except ConfigError as exc:
        raise _fail(exc) from None
    if output == "json":
        sys.stdout.write(json_text({"workloads": [r.as_json() for r in rows]}) + "\n")
        return
    out.print(f"Placement at {at}", markup=False)
    emit(table(["name", "kind", "requested", "placed", "state", Col("reason", wrap=True)],
               [(r.name, r.kind, r.requested_class, _placed(r.requested_class, r.placed_class), r.state, r.reason)
                for r in rows]))


def _placed(requested: str, placed: str | None) -> Text:
    if placed is None:
        return Text("-")
    if placed != requested:
        return Text.assemble((placed, "yellow"), " (fallback)")
    return Text(placed)


@app.command("model-size", rich_help_panel="Run Tensora")
def model_size_command(
    path: Annotated[Path, typer.Argument(help="a .safetensors file or a model directory")],
    cpu_limit: Annotated[float, typer.Option(help="CPU size limit in parameters")] = 8.5e9,
    output: Output = "table",
) -> None:
    """Parameters, bytes and dtypes of a safetensors model, from its headers; and whether it may run on CPU."""
    _check_output(output)
    try:
        size = read_model(path)
    except ModelFileError as exc:
        raise _fail(exc) from None
    verdict = check_cpu(size, cpu_limit)
    if output == "json":
        sys.stdout.write(json.dumps({"params": size.params, "bytes": size.bytes, "dtypes": dict(size.dtypes),
                                     "files": list(size.files), "cpu_allowed": verdict.allowed,
                                     "cpu_param_limit": cpu_limit}) + "\n")
        return
    out.print(f"{size.describe()}\nCPU fallback: {'allowed' if verdict.allowed else 'not allowed'} ({verdict.reason})",
              highlight=False)


@app.command("serve", rich_help_panel="Run Tensora")
def serve_command(
    data_dir: Annotated[Path | None, typer.Option(help="where the SQLite store and admin-key live")] = None,
    driver: Annotated[str | None, typer.Option(help="simulated | local | kubernetes")] = None,
    nodes: Annotated[Path | None, typer.Option(help="nodes.yaml of the simulated fleet")] = None,
    catalog: CatalogFile = None,
    host: Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8700)")] = None,
    region: Annotated[str | None, typer.Option(help="the region this server and controller serve")] = None,
    database_url: Annotated[str | None, typer.Option(help="postgresql://... (default: SQLite in --data-dir)")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML file of settings (flags and TENSORA_* env win)")] = None,
    no_controller: Annotated[bool, typer.Option("--no-controller", help="API only (another process leads)")] = False,
    workers: Annotated[int | None, typer.Option(help="HTTP worker processes (default 1)")] = None,
) -> None:
    """The control API and the region's controller (SQLite by default; PostgreSQL by URL)."""
    flags = {"data_dir": data_dir, "driver": driver, "nodes": nodes, "catalog": catalog, "host": host,
             "port": port, "region": region, "database_url": database_url,
             "controller": False if no_controller else None, "workers": workers}
    _serve(config, flags, "serve")


def _serve(config: Path | None, flags: dict[str, Any], profile: str) -> None:
    """Settings, then serve until interrupted; a bad setting exits 2, an unreachable database 1, and so
    does ``tensora up`` where one already runs or its port is taken."""
    from tensora import serve
    from tensora.config.settings import load_settings
    from tensora.serving.ports import Occupied

    try:
        settings = load_settings(config, flags)
        serve.run(settings, profile=profile)
    except ConfigError as exc:
        raise _fail(exc) from None
    except StoreUnavailable as exc:
        raise _fail(ValueError(f"the database is unavailable: {exc}"), code=1) from None
    except Occupied as exc:
        raise _fail(exc, code=1) from None


@app.command("gateway", rich_help_panel="Run Tensora")
def gateway_command(
    data_dir: Annotated[Path | None, typer.Option(help="the server's data dir: admin-key, and gateway/ for the "
                                                  "route cache and usage spool (env TENSORA_DATA_DIR)")] = None,
    control_url: Annotated[str | None, typer.Option(help="the control API (default http://127.0.0.1:8700)")] = None,
    host: Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8701)")] = None,
    region: Annotated[str | None, typer.Option(help="the region this gateway serves")] = None,
    redis_url: Annotated[str | None, typer.Option(help="redis://... to share rate limits between gateways")] = None,
    key_file: Annotated[Path | None, typer.Option(help="admin key file (default DATA_DIR/admin-key; or env "
                                                  "TENSORA_GATEWAY_KEY)")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML settings file; its gateway: section applies")] = None,
) -> None:
    """The OpenAI-compatible inference gateway: keys, rate limits, metering, the fallback chain."""
    from tensora import serve
    from tensora.gateway.app import run

    flags = {"data_dir": data_dir, "control_url": control_url, "host": host, "port": port, "region": region,
             "redis_url": redis_url, "key_file": key_file}
    try:
        run(serve.load_gateway_settings(config, flags))
    except ConfigError as exc:
        raise _fail(exc) from None


@app.command("up", rich_help_panel="Run Tensora")
def up_command(
    data_dir: Annotated[Path | None, typer.Option(help="where the SQLite store, admin-key, replicas and logs live "
                                                  "(env TENSORA_DATA_DIR)")] = None,
    host: Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="control API port (default 8700; its metrics on port + 10)")] = None,
    gateway_port: Annotated[int | None, typer.Option(help="inference gateway port (default 8701; its metrics on "
                                                     "port + 10)")] = None,
    catalog: CatalogFile = None,
    config: Annotated[Path | None, typer.Option(help="YAML file of settings, e.g. node: {reserve_cpu: 2}")] = None,
) -> None:
    """Tensora on this machine: the control API, the controller with the local driver (real notebooks,
    VMs and model servers as child processes) and the inference gateway; one per data dir. Ctrl-C stops
    the servers, not the workloads."""
    _serve(config, {"data_dir": data_dir, "driver": "local", "host": host, "port": port, "catalog": catalog,
                    "gateway_port": gateway_port}, "up")


@app.command("node", rich_help_panel="Run Tensora")
def node_command(
    config: Annotated[Path | None, typer.Option(help="YAML file of settings (its node: section applies)")] = None,
    catalog: CatalogFile = None,
    output: Output = "table",
) -> None:
    """This machine as the local driver sees it: detected CPU, memory and GPUs, and the node it offers."""
    from tensora.config.catalog import load_catalog
    from tensora.config.settings import describe_isolation, isolation_of, load_settings
    from tensora.drivers import hardware

    _check_output(output)
    try:
        settings = load_settings(config, {"catalog": catalog})
        cat = load_catalog(settings.catalog)
    except ConfigError as exc:
        raise _fail(exc) from None
    hw = hardware.detect(cat)
    node = hardware.local_node(hw, settings.node, settings.region)
    info = hardware.describe(hw, node)
    info["node"]["notes"] = notes = hardware.gpu_notes(node, cat)
    mode, why = isolation_of(settings.model_copy(update={"driver": "local"}))  # as tensora up runs it
    info["isolation"] = {"mode": mode, "reason": why}
    if output == "json":
        sys.stdout.write(json.dumps(info) + "\n")
        return
    out.print(f"detected: {hw.cpu} cores, {format_memory(hw.memory)} memory, GPUs via {hw.source}")
    for g in hw.gpus:
        out.print(f"  GPU {g.index}: {g.name}, {format_memory(g.memory)} -> {g.model or 'no catalog class'}")
    for note in hw.notes:
        out.print(f"  note: {note}")
    cores = settings.node.cpu if settings.node.cpu is not None else float(hw.cpu)
    out.print(f"offered as node {node.name} ({node.region}): {hardware.offered(node)} (after the host reserve "
              f"of {hardware.reserve_cpu(cores, settings.node):g} cores, {settings.node.reserve_memory})",
              highlight=False, soft_wrap=True)
    for note in notes:
        out.print(f"  note: {note}", highlight=False, soft_wrap=True)
    out.print(describe_isolation(mode, why), highlight=False, soft_wrap=True)


dev_app = typer.Typer(help="Tools for development and demos.", no_args_is_help=True)
app.add_typer(dev_app, name="dev", rich_help_panel="Run Tensora")


@dev_app.command("tiny-model")
def tiny_model_command(
    directory: Annotated[Path, typer.Argument(help="where to write it (created; must be empty)")],
    seed: Annotated[int, typer.Option(help="seed of the random weights and the tokenizer's made-up words")] = 0,
) -> None:
    """Write a tiny random Llama (safetensors, byte-level BPE tokenizer, chat template): no download."""
    from tensora.models.tinymodel import write_tiny_model
    from tensora.models.validator import read_model

    try:
        write_tiny_model(directory, seed)
        size = read_model(directory)
    except (TensoraError, ModelFileError) as exc:
        raise _fail(exc) from None
    out.print(f"wrote {directory}: {size.describe()}, LlamaForCausalLM, vocab 1024", highlight=False, soft_wrap=True)


runtime_app = typer.Typer(help="Model-server runtimes for endpoints on this machine.", no_args_is_help=True)
app.add_typer(runtime_app, name="runtime", rich_help_panel="Run Tensora")
RuntimesDir = Annotated[Path | None, typer.Option(
    "--runtimes-dir", help="where runtimes live (default DATA_DIR/runtimes; env TENSORA_RUNTIMES_DIR)")]
DataDir = Annotated[Path | None, typer.Option(help="the data dir of tensora up (env TENSORA_DATA_DIR)")]


def _runtimes_root(runtimes_dir: Path | None, data_dir: Path | None) -> Path:
    from tensora.config.settings import default_data_dir
    from tensora.models import runtimes

    if runtimes_dir is not None:
        return runtimes_dir
    return runtimes.runtimes_dir(data_dir or Path(os.environ.get("TENSORA_DATA_DIR") or default_data_dir()))


@runtime_app.command("list")
def runtime_list(runtimes_dir: RuntimesDir = None, data_dir: DataDir = None, output: Output = "table") -> None:
    """The runtimes, which kinds prefer them, and which are installed."""
    from tensora.models import runtimes

    _check_output(output)
    root = _runtimes_root(runtimes_dir, data_dir)
    rows: list[dict[str, Any]] = [
            {"name": r.name, "description": r.description, "installed": runtimes.installed(root, r.name),
             "preferred_for": [k for k, names in runtimes.PREFERRED.items() if r.name in names]}
            for r in runtimes.REGISTRY.values()]
    if output == "json":
        sys.stdout.write(json.dumps({"runtimes_dir": str(root), "runtimes": rows}) + "\n")
        return
    emit(table(["name", "installed", "preferred for", Col("description", wrap=True)],
               [(r["name"], "yes" if r["installed"] else "no", ", ".join(r["preferred_for"]) or "-", r["description"])
                for r in rows]))
    out.print(f"in {root}", highlight=False, soft_wrap=True)


@runtime_app.command("install")
def runtime_install(name: Annotated[str, typer.Argument(help="e.g. tensora-transformers")],
                    runtimes_dir: RuntimesDir = None, data_dir: DataDir = None) -> None:
    """Create NAME's own Python environment and install its packages (pinned torch: no CUDA build sneaks in)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tensora.models import runtimes

    root = _runtimes_root(runtimes_dir, data_dir)
    if name in runtimes.REGISTRY and not runtimes.installed(root, name):
        out.print(f"installing {name} (its own environment; a few minutes)", highlight=False, soft_wrap=True)
    with Progress(TextColumn("step {task.completed:.0f} of {task.total:.0f}"), BarColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(), console=out, transient=True) as bar:
        task = bar.add_task("", total=runtimes.STEPS)

        def tell(line: str) -> None:
            n, what = runtimes.step(line)
            bar.update(task, completed=n, description=what)

        try:
            where = runtimes.install(root, name, progress=tell)
        except runtimes.RuntimeNotAvailable as exc:
            raise _fail(exc, code=1 if name in runtimes.REGISTRY else 2) from None
    out.print(f"{name} installed in {where}", highlight=False, soft_wrap=True)


