"""``tensora login``: check a key against the API and save it as a profile."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import IO, Annotated

import typer

from tensora.cli import profile
from tensora.cli.common import (
    API_ERROR,
    UNREACHABLE,
    USAGE,
    app,
    fail,
    out,
)
from tensora.errors import ConfigError


@app.command("login", rich_help_panel="Use Tensora")
def login_command(ctx: typer.Context,
                  api_key: Annotated[str | None, typer.Option(
                      "--api-key", help="the key to log in with (where else it may come from: below)")] = None,
                  key_file: Annotated[Path | None, typer.Option(
                      help="read the key from this file, e.g. DATA_DIR/admin-key of tensora up")] = None,
                  profile_name: Annotated[str, typer.Option("--profile", help="save under this name")] = "default",
                  ) -> None:
    """Check a key against the API, save URL and key as a profile (file mode 0600) and make it the
    current one: later commands, and the SDK's Client(), use it. The key comes from --key-file, else
    --api-key / TENSORA_API_KEY, else stdin when a key is piped in, else (with the API on this
    machine) the admin key tensora up wrote in its data dir (TENSORA_DATA_DIR, else the default),
    else a prompt."""
    from tensora.sdk import APIConnectionError, APIError, Client
    from tensora.sdk.client import DEFAULT_API_URL, DEFAULT_GATEWAY_URL

    o = ctx.find_root().obj or {}
    api_url = o.get("api_url") or DEFAULT_API_URL
    key = api_key or o.get("api_key")
    source = None  # the file the key came from, said back (the key never is)
    if key_file is None and not key and _piped(sys.stdin):
        key = sys.stdin.readline().strip()
    if key_file is None and not key:
        key_file = source = profile.local_admin_key(api_url, os.environ)
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise fail(f"{key_file}: {exc.strerror or exc}") from None
    if not key and sys.stdin.isatty():
        key = typer.prompt("API key", hide_input=True).strip()
    if not key:
        raise fail("no API key given: pass --api-key or --key-file, or pipe the key in")
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
    out.print(f"logged in to {t.api_url} with {used} (...{key[-4:]}); profile {profile_name!r} saved in {path} "
              "and made current: later commands and the SDK use it", markup=False)


def _piped(stream: IO[str]) -> bool:
    """Whether a key may come on ``stream``: a pipe or a file, not a terminal (the prompt reads that) nor a
    device such as /dev/null."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError):  # closed, or not a real file (a test's replacement)
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)
