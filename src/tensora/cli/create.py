"""``tensora notebook|vm|endpoint create``: a workload queued for its class (and fallbacks), followed with --wait."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer

from tensora.cli.common import (
    Output,
    app,
    check_output,
    fail,
)
from tensora.cli.root import (
    api_failure,
    dump,
    session,
    show,
    upload_hint,
    wait_running,
    warn,
)
from tensora.units import parse_duration

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
    from tensora.sdk import APIError

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
