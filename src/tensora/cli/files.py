"""``tensora files``: your storage, through the SDK. ``upload`` (a directory is a model: every
file under it, with one progress bar over all their bytes), ``list`` and ``rm``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from tensora.cli.common import Output, app, check_output, emit, err, fail, out, table
from tensora.cli.root import dump, local_time, session
from tensora.storage import FileList, FileOut
from tensora.units import format_memory

files_app = typer.Typer(help="Your files: models (a directory of safetensors files) and disk images, named "
                        "in --model and --image.", no_args_is_help=True)
app.add_typer(files_app, name="files", rich_help_panel="Use Tensora")


class SizeColumn(ProgressColumn):
    """Sent of total, and the rate, in the sizes the rest of Tensora writes (``units.format_memory``: ``512Mi``),
    not rich's own ``kB``."""

    def render(self, task: Task) -> Text:
        sent = f"{format_memory(int(task.completed))}/{format_memory(int(task.total or 0))}"
        speed = f" {format_memory(int(task.speed))}/s" if task.speed else ""
        return Text(sent + speed, style="progress.download")


@files_app.command("upload")
def upload(ctx: typer.Context,
           local: Annotated[Path, typer.Argument(help="a file, or a directory (a model: every file under it)")],
           name: Annotated[str | None, typer.Argument(help="its name in your storage (default: LOCAL's own "
                                                      "name), e.g. tiny or images/debian.qcow2")] = None,
           output: Output = "table") -> None:
    """Upload a file or a model directory, with a progress bar; re-uploading a name replaces it."""
    from tensora.sdk import Client

    check_output(output)
    if not local.exists():
        raise fail(f"{local}: no such file or directory")
    name = name or local.resolve().name
    if local.is_dir():
        parts = [(p, f"{name.rstrip('/')}/{rel}") for p, rel in Client.local_files(local)]
        if not parts:
            raise fail(f"{local}: no files to upload (hidden files are left out)")
    else:
        parts = [(local, name)]
    total = sum(p.stat().st_size for p, _ in parts)
    done: list[FileOut] = []
    with session(ctx) as c, Progress(TextColumn("{task.description}"), BarColumn(), SizeColumn(),
                                     TimeRemainingColumn(), console=err,
                                     transient=True) as bar:
        task = bar.add_task(f"uploading {name}", total=total)
        for path, target in parts:
            base = sum(f.size for f in done)
            bar.update(task, description=target)

            def progress(sent: int, base: int = base) -> None:
                bar.update(task, completed=base + sent)

            done.append(c.upload_file(path, target, on_progress=progress))
    if output == "json":
        dump(done)
        return
    _table(done)
    err.print(f"uploaded {len(done)} file{'s' if len(done) != 1 else ''}, {format_memory(total)}, as {name}")


@files_app.command("list")
def list_files(ctx: typer.Context,
               prefix: Annotated[str | None, typer.Argument(help="only this file or directory")] = None,
               output: Output = "table") -> None:
    """Your files, the room they take and your quota."""
    check_output(output)
    with session(ctx) as c:
        page = c.list_files(prefix)
    if output == "json":
        dump(page)
        return
    _table(page.data)
    _room(page)


@files_app.command("rm")
def remove(ctx: typer.Context, name: Annotated[str, typer.Argument(help="a file, or a directory: all its files")],
           output: Output = "table") -> None:
    """Delete a file, or every file of a directory (a model)."""
    check_output(output)
    with session(ctx) as c:
        page = c.delete_file(name)
    if output == "json":
        dump(page)
        return
    gone = sum(f.size for f in page.data)
    out.print(f"removed {len(page.data)} file{'s' if len(page.data) != 1 else ''} ({format_memory(gone)}) "
              f"of {name}")
    _room(page)


def _table(files: list[FileOut]) -> None:
    """Paths whole on one line, however narrow the terminal (they are what you type next), as every table of
    the CLI (``common.table``); the sha256 shortened to 12 hex digits (``-o json`` has it all)."""
    emit(table(["path", "size", "sha256", "uploaded"],
               [(f.path, format_memory(f.size), f.sha256[:12], local_time(f.created_at)) for f in files]))


def _room(page: FileList) -> None:
    err.print(f"{format_memory(page.used)} of {format_memory(page.quota)} used")
