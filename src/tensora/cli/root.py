"""The root of the commands over the control API, through the SDK only: the global options, the session, how
a workload prints and how --wait follows it. The command groups (one module each) parse, call ``tensora.sdk`` and
print a table (or ``-o json``). The SDK (httpx, the API's schemas) is imported by the functions that call it: the
offline commands (``tensora plan``) and ``--help`` start without it."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from tensora.cli import profile
from tensora.cli.common import (
    API_ERROR,
    ENDED,
    TIMEOUT,
    UNREACHABLE,
    api_error_text,
    app,
    emit,
    err,
    fail,
    fields,
)
from tensora.errors import ConfigError
from tensora.storage import NOT_FOUND
from tensora.units import format_duration

if TYPE_CHECKING:
    from tensora.sdk import APIError, Client, Workload

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
    from tensora.sdk import APIConnectionError, APIError, APITimeoutError, Client

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


def local_time(iso: str | None, zone: dt.tzinfo | None = None) -> str:
    """An API time (ISO 8601, UTC) in this machine's time zone (or ``zone``), which it names: ``2026-12-07
    14:32:10 CET``; a zone without a name shows its offset (``+0530``)."""
    if not iso:
        return "-"
    at = dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(zone)
    name = at.tzname() or ""
    if not name or name.startswith(("+", "-", "UTC+", "UTC-")):
        name = at.strftime("%z")
    return f"{at.strftime('%Y-%m-%d %H:%M:%S')} {name}"


def fallback_text(fallback: Sequence[str], after_s: float) -> str:
    """The fallback list and its wait as they are typed: ``cpu, after 10m``."""
    if not fallback:
        return "none (waits for its class)"
    return f"{', '.join(fallback)}, after {format_duration(after_s)}"


def placed(w: Workload) -> Text:
    if w.placed_class is None:
        return Text("-")
    if w.placed_class != w.requested_class:
        return Text.assemble((w.placed_class, "yellow"), " (fallback)")
    return Text(w.placed_class)


def show(w: Workload) -> None:
    """One workload, as a list of fields."""
    rows: list[tuple[str, str | Text]] = [
        ("id", w.id), ("name", f"{w.name} ({w.kind})"), ("state", w.state), ("requested", w.requested_class),
        ("placed", placed(w)), ("fallback", fallback_text(w.fallback, w.fallback_after_s)),
        ("reason", w.reason), ("region", w.region)]
    rows += [(c.type, f"{c.reason}: {c.message}") for c in w.conditions]
    if w.restart_available:
        rows.append(("restart", f"available: {w.restart_reason} (tensora workloads restart {w.id} --on-requested)"))
    if w.access and w.access.get("url"):
        rows.append(("url", str(w.access["url"])))
    elif w.kind in ("notebook", "vm") and w.state in ("stopped", "failed"):  # nowhere to reach: how to bring it back
        rows.append(("access", f"{w.state}: start it again with tensora workloads restart {w.name}"))
    for r in w.replicas or []:
        rows.append(("replica", f"{r.id} {r.class_} {r.state} {r.role} {r.url or ''}".rstrip()))
    if w.model:
        rows.append(("model", w.model))
    emit(fields(rows))


def warn(w: Workload) -> None:
    """The workload's warning, and those of a create answer (``warnings``), each once, on stderr."""
    for text in dict.fromkeys([*([w.warning] if w.warning else []), *w.warnings]):
        err.print(Text.assemble(("warning:", "yellow"), f" {text}"))


def wait_running(c: Client, w: Workload, timeout_s: float) -> Workload:
    """Follow the workload until it runs: a spinner on a terminal, a line per change otherwise."""
    from tensora.sdk import WaitTimeoutError, WorkloadEndedError

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
