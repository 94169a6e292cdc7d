"""The CLI reference: every command of ``tensora`` (the typer app, as click sees it) with its usage, arguments and
options, each option as ``--help`` shows it (its flags, value type, help, default and environment variable)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tensora.docsgen import markdown as md


def _commands(command: Any, path: list[str], parent: Any = None) -> Iterator[tuple[list[str], Any, Any]]:
    ctx = command.context_class(command, info_name=path[-1], parent=parent)
    if command.hidden:
        return
    yield path, command, ctx
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                yield from _commands(sub, [*path, name], ctx)


def render() -> str:
    import typer.main

    from tensora.cli import app

    root = typer.main.get_command(app)
    commands = list(_commands(root, ["tensora"]))
    out = ["# CLI reference\n", md.HEADER,
           "Every command of `tensora`, as `tensora COMMAND --help` shows it. Commands that talk to the control API "
           "take the global options of `tensora` itself (before the command).\n"]
    out.append("\n".join(f"- [`{' '.join(path)}`](#{'-'.join(path)})" for path, _, _ in commands) + "\n")
    for path, command, ctx in commands:
        name = " ".join(path)
        out.append(f"## {name} {{#{'-'.join(path)}}}\n")
        if command.help:
            out.append(md.paragraphs(command.help))
        out.append(f"```text\n{name} {' '.join(command.collect_usage_pieces(ctx))}\n```\n")
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        if arguments:
            out.append(md.table(["Argument", "Required", "Help"], (
                [md.code(" ".join(p.get_usage_pieces(ctx)) or p.name),
                 "yes" if p.required else "no", md.cell(getattr(p, "help", None) or "")] for p in arguments)))
        options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
        records = [r for r in (p.get_help_record(ctx) for p in options) if r is not None]
        if records:
            out.append(md.table(["Option", "Help"], ([md.code(flags), md.cell(help_)] for flags, help_ in records)))
    return "\n".join(out)
