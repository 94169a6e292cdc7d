"""The commands over the control API, through the SDK only: create, workloads, catalog, usage,
keys, login. They parse, call ``tensora.sdk``, and print a table (or ``-o json``)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from tensora.cli import profile
from tensora.cli.common import (
    API_ERROR,
    ENDED,
    TIMEOUT,
    UNREACHABLE,
    USAGE,
    Col,
    Output,
    api_error_text,
    app,
    check_output,
    emit,
    err,
    fail,
    fields,
    out,
    table,
)
from tensora.errors import ConfigError
from tensora.placement.quotas import Limits, Quotas
from tensora.sdk import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    Client,
    WaitTimeoutError,
    Workload,
    WorkloadEndedError,
)
from tensora.sdk.client import DEFAULT_API_URL, DEFAULT_GATEWAY_URL
from tensora.storage import NOT_FOUND
from tensora.units import format_memory, parse_duration, parse_memory

POLL_S = 0.5  # --wait: how often the state is read (one cheap GET)


@app.callback()
def options(
    ctx: typer.Context,
    api_url: Annotated[str | None, typer.Option(envvar="TENSORA_API_URL", help="the control API "
                                                "(default: the profile's, else http://127.0.0.1:8700)")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TENSORA_API_KEY", show_envvar=True,
                                                help="API key (default: the profile's)")] = None,
    gateway_url: Annotated[str | None, typer.Option(envvar="TENSORA_GATEWAY_URL", help="the inference gateway "
                                                    "(default: the profile's, else http://127.0.0.1:8701)")] = None,
    profile_name: Annotated[str | None, typer.Option("--profile", envvar="TENSORA_PROFILE",
                                                     help="a profile saved by tensora login")] = None,
) -> None:
    """Tensora: a free GPU cloud with opt-in, explicit and visible fallbacks."""
    ctx.obj = {"api_url": api_url, "api_key": api_key, "gateway_url": gateway_url, "profile": profile_name}


def target(ctx: typer.Context) -> profile.Target:
    o = ctx.find_root().obj or {}
    try:
        return profile.resolve(o.get("api_url"), o.get("api_key"), o.get("gateway_url"), o.get("profile"))
    except ConfigError as exc:
        raise fail(exc) from None


def api_failure(exc: APIError, flags: Mapping[str, str], hint: str = "") -> typer.Exit:
    """An API's answer as an error; a field the API names is said as the command's flag (``flags``),
    and ``hint`` (what to do about it) follows on a line of its own."""
    text = api_error_text(exc.status, exc.message, exc.field, exc.request_id, flags)
    return fail(f"{text}\n{hint}" if hint else text, API_ERROR)


def upload_hint(exc: APIError, names: Mapping[str, str], flags: Mapping[str, str]) -> str:
    """A name the API found nowhere (``model``, ``image``) that is a file or directory here: the user
    meant this machine's copy, which the server never reads. Say how to upload it and what to name."""
    typed = names.get(exc.field or "")
    if exc.status != 422 or typed is None or exc.message != NOT_FOUND:
        return ""
    local = Path(typed).expanduser()
    if not local.exists():
        return ""
    what = "a directory" if local.is_dir() else "a file"
    name = local.resolve().name
    return (f"{typed} is {what} on this machine; the server reads only your uploaded files: "
            f"tensora files upload {shlex.quote(typed)}, then {flags.get(exc.field or '', '--model')} "
            f"{shlex.quote(name)}")


@contextlib.contextmanager
def session(ctx: typer.Context, flags: Mapping[str, str] | None = None) -> Iterator[Client]:
    """A client for the resolved target; SDK errors become messages and exit codes, and an API
    field named in an error becomes the flag of ``flags`` (API field -> flag) that set it."""
    t = target(ctx)
    if not t.api_key:
        raise fail("no API key: set TENSORA_API_KEY, pass --api-key, or run tensora login "
                   "(tensora up prints where its admin key is)")
    try:
        with Client(t.api_key, t.api_url, gateway_url=t.gateway_url) as c:
            yield c
    except APITimeoutError as exc:
        raise fail(exc, TIMEOUT) from None
    except APIConnectionError as exc:
        raise fail(f"{exc} (is tensora up or tensora serve running?)", UNREACHABLE) from None
    except APIError as exc:
        raise api_failure(exc, flags or {}) from None
    except ValueError as exc:  # e.g. a name that several workloads share
        raise fail(exc) from None


def dump(value: Any) -> None:
    if isinstance(value, list):
        value = {"data": [v.model_dump(mode="json", by_alias=True) for v in value]}
    elif hasattr(value, "model_dump"):
        value = value.model_dump(mode="json", by_alias=True)
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def local_time(iso: str | None) -> str:
    if not iso:
        return "-"
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def placed(w: Workload) -> Text:
    if w.placed_class is None:
        return Text("-")
    if w.placed_class != w.requested_class:
        return Text.assemble((w.placed_class, "yellow"), " (fallback)")
    return Text(w.placed_class)


def show(w: Workload) -> None:
    """One workload, as a list of fields."""
    fallback = ", ".join(w.fallback) or "none (waits for its class)"
    rows: list[tuple[str, str | Text]] = [
        ("id", w.id), ("name", f"{w.name} ({w.kind})"), ("state", w.state), ("requested", w.requested_class),
        ("placed", placed(w)), ("fallback", f"{fallback}, after {w.fallback_after_s:g}s" if w.fallback else fallback),
        ("reason", w.reason), ("region", w.region)]
    rows += [(c.type, f"{c.reason}: {c.message}") for c in w.conditions]
    if w.restart_available:
        rows.append(("restart", f"available: {w.restart_reason} (tensora workloads restart {w.id} --on-requested)"))
    if w.access and w.access.get("url"):
        rows.append(("url", str(w.access["url"])))
    for r in w.replicas or []:
        rows.append(("replica", f"{r.id} {r.class_} {r.state} {r.role} {r.url or ''}".rstrip()))
    if w.model:
        rows.append(("model", w.model))
    emit(fields(rows))


def warn(w: Workload) -> None:
    if w.warning:
        err.print(Text.assemble(("warning:", "yellow"), f" {w.warning}"))


def wait_running(c: Client, w: Workload, timeout_s: float) -> Workload:
    """Follow the workload until it runs: a spinner on a terminal, a line per change otherwise."""
    def line(x: Workload) -> Text:  # a Text: a reason is shown as is, never read as markup
        return Text(f"{x.name}: {x.state}: {x.reason}")

    try:
        if err.is_terminal:
            with err.status(line(w)) as spinner:
                return c.wait_until(w.id, ("running",), timeout_s, poll_s=POLL_S,
                                    on_change=lambda x: spinner.update(line(x)))
        return c.wait_until(w.id, ("running",), timeout_s, poll_s=POLL_S, on_change=lambda x: err.print(line(x)))
    except WaitTimeoutError as exc:
        raise fail(f"{exc} (it keeps waiting; tensora workloads get {w.id})", TIMEOUT) from None
    except WorkloadEndedError as exc:
        raise fail(f"{exc}; see tensora workloads events {w.id}", ENDED) from None


# -- create -----------------------------------------------------------------------------------

GpuClass = Annotated[str, typer.Option("--gpu-class", help="the class asked for, e.g. l40s-48gb (tensora catalog)")]
Fallback = Annotated[str, typer.Option(help="substitutes accepted, in order, comma-separated: other classes or "
                                            "'cpu' (roughly 10-50x slower). Default: none, wait for --gpu-class")]
FallbackAfter = Annotated[str | None, typer.Option(help="how long to wait for --gpu-class first: 10m, 90s, 0")]
Region = Annotated[str | None, typer.Option(help="default: the server's")]
Spec = Annotated[list[str] | None, typer.Option("--spec", help="a kind-specific setting KEY=VALUE (VALUE as JSON "
                                                               "if it parses), repeatable")]
Wait = Annotated[bool, typer.Option("--wait", help="follow it until it runs (or fails)")]
Timeout = Annotated[str, typer.Option(help="how long --wait waits: 15m, 90s")]
IdemKey = Annotated[str | None, typer.Option(help="your own Idempotency-Key (default: a fresh one per command)")]

# API field -> the flag (or argument) that sets it, per command: an API error names what was typed
CREATE_FLAGS = {"name": "NAME", "gpu_class": "--gpu-class", "fallback": "--fallback",
                "fallback_after": "--fallback-after", "fallback_after_s": "--fallback-after", "region": "--region",
                "spec": "--spec", "Idempotency-Key": "--idempotency-key"}
NOTEBOOK_FLAGS = CREATE_FLAGS
VM_FLAGS = {**CREATE_FLAGS, "image": "--image"}
ENDPOINT_FLAGS = {**CREATE_FLAGS, "model": "--model", "model_params": "--model", "model_bytes": "--model",
                  "replicas": "--replicas", "fallback_models": "--fallback-model",
                  "allow_cross_region": "--allow-cross-region"}
LIST_FLAGS = {"kind": "--kind", "state": "--state"}
USAGE_FLAGS = {"group_by": "--group-by", "since": "--since", "until": "--since", "owner": "--owner"}
KEY_FLAGS = {"name": "--name", "scopes": "--scope", "owner": "--owner", "requests_per_minute": "--rpm",
             "tokens_per_minute": "--tpm", "Idempotency-Key": "--idempotency-key"}
OWNER_FLAGS = {"owner": "OWNER", "trusted": "--trusted/--untrusted", "quotas": "--quota", "limits": "--limit",
               **{f"quotas.{n}": f"--quota {n}" for n in Quotas.model_fields},
               **{f"limits.{n}": f"--limit {n}" for n in Limits.model_fields}}


def _spec(items: Sequence[str] | None) -> dict[str, Any] | None:
    if not items:
        return None
    spec: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise fail(f"--spec {item!r}: expected KEY=VALUE")
        try:
            spec[key] = json.loads(raw)
        except ValueError:
            spec[key] = raw
    return spec


def _create(ctx: typer.Context, kind: str, name: str, gpu_class: str, fallback: str, fallback_after: str | None,
            wait: bool, timeout: str, output: str, flags: Mapping[str, str], **more: Any) -> None:
    """``more`` goes to the API as is: ``model`` and ``image`` are names in the caller's files."""
    check_output(output)
    try:
        timeout_s = parse_duration(timeout)
    except ValueError as exc:
        raise fail(f"--timeout: {exc}") from None
    chain = [c.strip() for c in fallback.split(",") if c.strip()]
    with session(ctx, flags) as c:
        try:
            w = c.create_workload(kind, name, gpu_class, fallback=chain, fallback_after=fallback_after, **more)
        except APIError as exc:
            names = {k: more[k] for k in ("model", "image") if isinstance(more.get(k), str)}
            raise api_failure(exc, flags, upload_hint(exc, names, flags)) from None
        warn(w)
        if wait:
            w = wait_running(c, w, timeout_s)
    if output == "json":
        dump(w)
    else:
        show(w)


notebook_app = typer.Typer(help="JupyterLab notebooks.", no_args_is_help=True)
vm_app = typer.Typer(help="Virtual machines (QEMU).", no_args_is_help=True)
endpoint_app = typer.Typer(help="OpenAI-compatible inference endpoints.", no_args_is_help=True)
app.add_typer(notebook_app, name="notebook", rich_help_panel="Use Tensora")
app.add_typer(vm_app, name="vm", rich_help_panel="Use Tensora")
app.add_typer(endpoint_app, name="endpoint", rich_help_panel="Use Tensora")


@notebook_app.command("create")
def notebook_create(ctx: typer.Context, name: str, gpu_class: GpuClass, fallback: Fallback = "",
                    fallback_after: FallbackAfter = None, region: Region = None, spec: Spec = None,
                    wait: Wait = False, timeout: Timeout = "15m", idempotency_key: IdemKey = None,
                    output: Output = "table") -> None:
    """Create a notebook; its URL (with token) shows once it runs."""
    _create(ctx, "notebook", name, gpu_class, fallback, fallback_after, wait, timeout, output, NOTEBOOK_FLAGS,
            region=region, spec=_spec(spec), idempotency_key=idempotency_key)


@vm_app.command("create")
def vm_create(ctx: typer.Context, name: str, gpu_class: GpuClass, fallback: Fallback = "",
              fallback_after: FallbackAfter = None, region: Region = None,
              image: Annotated[str | None, typer.Option(help=(
                  "a disk image (qcow2/raw) to boot: its name in your files (tensora files upload), "
                  "or shared/<root>/<path>"))] = None,
              spec: Spec = None, wait: Wait = False, timeout: Timeout = "15m", idempotency_key: IdemKey = None,
              output: Output = "table") -> None:
    """Create a VM (on a GPU class: that GPU passed through, where the host allows)."""
    _create(ctx, "vm", name, gpu_class, fallback, fallback_after, wait, timeout, output, VM_FLAGS, region=region,
            image=image, spec=_spec(spec), idempotency_key=idempotency_key)


@endpoint_app.command("create")
def endpoint_create(ctx: typer.Context, name: str, gpu_class: GpuClass,
                    model: Annotated[str, typer.Option(help=(
                        "a safetensors model (file or directory): its name in your files (tensora files upload "
                        "DIR), or shared/<root>/<path>"))],
                    fallback: Fallback = "", fallback_after: FallbackAfter = None, region: Region = None,
                    replicas: Annotated[int | None, typer.Option(help="replicas to run (default 1)")] = None,
                    fallback_model: Annotated[list[str] | None, typer.Option(
                        "--fallback-model", help="a smaller model (endpoint or curated) to answer when no replica "
                                                 "can, repeatable, in order")] = None,
                    allow_cross_region: Annotated[bool, typer.Option(
                        "--allow-cross-region", help="let another region's replicas answer (data leaves)")] = False,
                    spec: Spec = None, wait: Wait = False, timeout: Timeout = "15m", idempotency_key: IdemKey = None,
                    output: Output = "table") -> None:
    """Create an endpoint; call it through the gateway with model=NAME (tensora chat NAME)."""
    _create(ctx, "endpoint", name, gpu_class, fallback, fallback_after, wait, timeout, output, ENDPOINT_FLAGS,
            region=region, model=model, replicas=replicas, fallback_models=fallback_model,
            allow_cross_region=allow_cross_region or None, spec=_spec(spec), idempotency_key=idempotency_key)


# -- workloads --------------------------------------------------------------------------------

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
    if output == "json":
        dump(rows)
        return
    emit(table(["id", "name", "kind", "state", "requested", "placed", Col("reason", wrap=True)],
               [(w.id, w.name, w.kind, w.state, w.requested_class, placed(w), w.reason) for w in rows]))


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
               [(local_time(e.at), e.type, f"{e.from_state or '-'} -> {e.to_state}" if e.to_state else "", e.reason)
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


# -- catalog, usage ---------------------------------------------------------------------------

@app.command("catalog", rich_help_panel="Use Tensora")
def catalog_command(ctx: typer.Context, output: Output = "table",
                    catalog: Annotated[Path | None, typer.Option(
                        "--catalog", help="show this catalog file instead, offline")] = None) -> None:
    """The compute classes workloads can ask for (and fall back to), with free capacity."""
    from tensora.config.catalog import load_catalog
    from tensora.units import format_memory

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
                      f"{cap['free']}/{cap['total']}" if cap else "-"))
    emit(table(["name", "kind", "gpu", "vCPU", "memory", "free/total"], lines))
    if note:
        out.print(note, markup=False)


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
        else:
            u = c.usage([g.strip() for g in group_by.split(",") if g.strip()], since=start, owner=owner)
    if tokens:
        if output == "json":
            dump(t)
            return
        columns = ["endpoint", "product", "model", "served_by", "requests", "prompt_tokens", "completion_tokens"]
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


# -- keys ---------------------------------------------------------------------------------------

keys_app = typer.Typer(help="API keys: create (the secret is shown once), list, revoke.", no_args_is_help=True)
app.add_typer(keys_app, name="keys", rich_help_panel="Use Tensora")


@keys_app.command("create")
def keys_create(ctx: typer.Context, name: Annotated[str, typer.Option(help="a label")] = "key",
                scope: Annotated[list[str] | None, typer.Option(
                    "--scope", help="repeatable: workloads:read, workloads:write, usage:read, inference, "
                                    "keys:write, admin (default: the defaults your key holds)")] = None,
                owner: Annotated[str | None, typer.Option(help="for another owner (admin keys)")] = None,
                rpm: Annotated[int | None, typer.Option(help="gateway requests per minute")] = None,
                tpm: Annotated[int | None, typer.Option(help="gateway tokens per minute")] = None,
                output: Output = "table") -> None:
    """Create a key; its secret is in this output only (only its digest is stored)."""
    check_output(output)
    with session(ctx, KEY_FLAGS) as c:
        k = c.create_key(name, scopes=scope, owner=owner, requests_per_minute=rpm, tokens_per_minute=tpm)
    if output == "json":
        dump(k)
        return
    out.print(f"{k.id} ({k.name}, owner {k.owner}): {', '.join(k.scopes)}", markup=False)
    if k.key is None:  # a retry whose first answer was lost: the key exists, its secret went with that answer
        raise fail(f"key {k.id} was created but its secret was lost on the way (it is shown once): revoke it "
                   f"with tensora keys revoke {k.id} and create another", API_ERROR)
    out.print(k.key, markup=False)
    err.print("[yellow]the key is shown once: keep it now[/yellow]")


@keys_app.command("list")
def keys_list(ctx: typer.Context, output: Output = "table") -> None:
    """Your keys (never their secrets)."""
    check_output(output)
    with session(ctx) as c:
        keys = c.list_keys()
    if output == "json":
        dump(keys)
        return
    emit(table(["id", "name", "owner", Col("scopes", wrap=True), "hint", "created", "rpm", "tpm"],
               [(k.id, k.name, k.owner, ", ".join(k.scopes), k.hint, local_time(k.created_at),
                 str(k.requests_per_minute or "-"), str(k.tokens_per_minute or "-")) for k in keys]))


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: Annotated[str, typer.Argument(help="the key's id")]) -> None:
    """Revoke a key: it stops working at once (at the gateway within its refresh)."""
    with session(ctx) as c:
        c.revoke_key(key_id)
    out.print(f"revoked {key_id}")


# -- owners -------------------------------------------------------------------------------------

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
                   "across all the owner's keys); NAME=default: back to the server's default")] = None,
               output: Output = "table") -> None:
    """Set an owner's flag, quotas and limits (admin keys); what is not named keeps its value. Trust applies to
    replicas started from now on; a lower quota refuses new creates past it and removes nothing."""
    check_output(output)
    quotas, limits = _settings(quota, "--quota", Quotas), _settings(limit, "--limit", Limits)
    if trusted is None and quotas is None and limits is None:
        raise fail("nothing to set: give --trusted/--untrusted, --quota or --limit")
    with session(ctx, OWNER_FLAGS) as c:
        _print_owners([c.set_owner(owner, trusted=trusted, quotas=quotas, limits=limits)], output)


# -- login --------------------------------------------------------------------------------------

@app.command("login", rich_help_panel="Use Tensora")
def login_command(ctx: typer.Context,
                  key_file: Annotated[Path | None, typer.Option(
                      help="read the key from this file, e.g. DATA_DIR/admin-key of tensora up")] = None,
                  profile_name: Annotated[str, typer.Option("--profile", help="save under this name")] = "default",
                  ) -> None:
    """Check a key against the API and save URL and key as a profile (file mode 0600). The key comes
    from --api-key / TENSORA_API_KEY, --key-file, else (with the API on this machine) the admin key
    tensora up wrote in its data dir (TENSORA_DATA_DIR, else the default), else a prompt (stdin
    when not a terminal)."""
    o = ctx.find_root().obj or {}
    api_url = o.get("api_url") or DEFAULT_API_URL
    key = o.get("api_key")
    source = None  # the file the key came from, said back (the key never is)
    if key_file is None and not key:
        key_file = source = profile.local_admin_key(api_url, os.environ)
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise fail(f"{key_file}: {exc.strerror or exc}") from None
    if not key:
        key = (typer.prompt("API key", hide_input=True) if sys.stdin.isatty() else sys.stdin.readline()).strip()
    if not key:
        raise fail("no API key given")
    t = profile.Target(api_url, key, o.get("gateway_url") or DEFAULT_GATEWAY_URL, profile_name)
    try:
        with Client(key, t.api_url) as c:
            c.list_workloads(limit=1)
    except APIConnectionError as exc:
        raise fail(exc, UNREACHABLE) from None
    except APIError as exc:
        whose = f"the key in {source} (pass --key-file or --api-key for another)" if source else "the key"
        raise fail(f"the API refused {whose}: {exc}", API_ERROR) from None
    try:
        path = profile.save(profile_name, t.api_url, key, t.gateway_url)
    except (ConfigError, OSError) as exc:
        raise fail(exc, USAGE) from None
    used = f"the admin key in {source}" if source else "the key"
    out.print(f"logged in to {t.api_url} with {used} (...{key[-4:]}); profile {profile_name!r} saved in {path}",
              markup=False)
