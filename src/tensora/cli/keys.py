"""``tensora keys``: API keys: create (the secret is shown once), list, revoke."""

from __future__ import annotations

from typing import Annotated

import typer

from tensora.cli.common import (
    API_ERROR,
    Col,
    Output,
    app,
    check_output,
    emit,
    err,
    fail,
    out,
    table,
)
from tensora.cli.root import (
    dump,
    local_time,
    session,
)

KEY_FLAGS = {"name": "--name", "scopes": "--scope", "owner": "--owner", "requests_per_minute": "--rpm",
             "tokens_per_minute": "--tpm", "Idempotency-Key": "--idempotency-key"}


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
