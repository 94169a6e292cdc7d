"""What every ``tensora`` command shares: the app, output (tables and fields), and errors as exit codes.

Exit codes (the SDK and CLI guide lists them too):

    0  ok
    1  the API answered with an error (the message says which, and its request id)
    2  bad usage, or a bad file or value (the message names it)
    3  a timeout: ``--wait`` passed its ``--timeout``, or the API did not answer in time
    4  the API could not be reached
    5  the workload failed or stopped while ``--wait`` waited for it to run

Output is for copying: an id, a name, a class or a URL is never wrapped nor cut, and no line ends
in a space. Piped, a table is as wide as its content: one line per row. On a terminal too, unless
wrapping its free text (reasons) at spaces makes it fit the terminal's width.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import orjson
import typer
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

OK, API_ERROR, USAGE, TIMEOUT, UNREACHABLE, ENDED = 0, 1, 2, 3, 4, 5

app = typer.Typer(help="Tensora: a free GPU cloud with opt-in, explicit and visible fallbacks.",
                  no_args_is_help=True, add_completion=False)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Output = Annotated[str, typer.Option("--output", "-o", help="table or json")]

UNLIMITED = 1 << 16  # "as wide as the content": the width a table is measured (and, piped, drawn) at


def reflow(text: str) -> str:
    """A docstring's paragraphs each as one line, so help is wrapped at the terminal's width, not at the source's
    line breaks (typer keeps those in its rich help: a line would end mid-sentence)."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n"))


def reflow_help(typer_app: typer.Typer) -> None:
    """:func:`reflow` the help of every command and group of ``typer_app``, once they are all registered."""
    for command in typer_app.registered_commands:
        doc = command.help or inspect.getdoc(command.callback)
        if doc:
            command.help = reflow(doc)
    for group in typer_app.registered_groups:
        if isinstance(group.help, str):
            group.help = reflow(group.help)
        if group.typer_instance is not None:
            sub = group.typer_instance.info
            if isinstance(sub.help, str):
                sub.help = reflow(sub.help)
            reflow_help(group.typer_instance)


def fail(exc: Exception | str, code: int = USAGE) -> typer.Exit:
    sys.stderr.write(f"error: {exc}\n")  # plain, unwrapped: scripts and people grep it
    return typer.Exit(code)


def check_output(output: str) -> None:
    if output not in ("table", "json"):
        raise fail(f"--output must be table or json, not {output!r}")


_PRINTABLE = re.compile(rb"[ -~\n]*")


def json_text(doc: object) -> str:
    """``json.dumps(doc, indent=2)``, byte for byte, in a tenth of the time (a 10,000-workload plan's report),
    for a ``doc`` of dicts with string keys, lists, strings, booleans, None and 64-bit integers (no floats: the
    two write some differently). orjson writes the same text wherever it is printable ASCII; json escapes every
    other character, where orjson writes some as they are: then json writes it."""
    fast = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
    return fast.decode() if _PRINTABLE.fullmatch(fast) else json.dumps(doc, indent=2)


# -- errors name the flag ---------------------------------------------------------------------

_INDEX = re.compile(r"\[\d+\]$")


def flag_for(field: str | None, flags: Mapping[str, str]) -> str | None:
    """The flag (or argument) of a command that set the API field ``field``, as the user typed it.

    ``flags`` maps the command's API fields to its flags. A list item (``fallback[1]``) is its
    list's flag; a key under ``spec`` is ``--spec KEY``; a field the command has no flag for
    (one it sets itself) is None."""
    if not field:
        return None
    if field in flags:
        return flags[field]
    bare = _INDEX.sub("", field)
    if bare in flags:
        return flags[bare]
    head, dot, rest = bare.partition(".")
    if dot and head == "spec" and "spec" in flags:
        return f"{flags['spec']} {rest}"
    return flags.get(head) if dot else None


def api_error_text(status: int | None, message: str, field: str | None, request_id: str | None,
                   flags: Mapping[str, str]) -> str:
    """An API error as the CLI says it: the flag first when the field has one, the field after."""
    flag = flag_for(field, flags)
    head = f"{status} " if status is not None else ""
    rid = f" [request {request_id}]" if request_id else ""
    if flag is not None:
        return f"{head}{flag}: {message} (API field {field}){rid}"
    where = f" (field {field})" if field else ""
    return f"{head}{message}{where}{rid}"


# -- tables and fields ------------------------------------------------------------------------

Cell = str | Text  # a str is shown as is (never parsed as markup); a Text keeps its styles


@dataclass(frozen=True, slots=True)
class Col:
    """A table column. Only free text (a reason, a list of scopes) may ``wrap``, and only at spaces;
    every other column (ids, names, classes, states, times, URLs) is one line, never cut."""

    name: str
    wrap: bool = False


def _text(cell: Cell) -> Text:
    return cell if isinstance(cell, Text) else Text(cell)


def table(columns: Sequence[Col | str], rows: Iterable[Sequence[Cell]]) -> Table:
    """Columns aligned by spaces (no box: nothing but the values to copy), headers in bold."""
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    cells = [[_text(c) for c in row] for row in rows]
    t = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for i, c in enumerate(cols):
        if c.wrap:
            t.add_column(c.name, overflow="fold")
        else:  # a fixed width: rich never narrows it to fit, so nothing in it wraps or is cut
            width = max([len(c.name), *(row[i].cell_len for row in cells)])
            t.add_column(c.name, no_wrap=True, width=width)
    for row in cells:
        t.add_row(*row)
    return t


def fields(rows: Sequence[tuple[str, Cell]]) -> Table:
    """One thing as ``key  value`` lines; a long value wraps at spaces under itself."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True, width=max((len(k) for k, _ in rows), default=1))
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, _text(v))
    return t


def _rstrip(line: list[Segment]) -> list[Segment]:
    while line and not line[-1].control and not line[-1].text.rstrip():
        line.pop()
    if line and not line[-1].control:
        last = line[-1]
        line[-1] = Segment(last.text.rstrip(), last.style)
    return line


def width_for(minimum: int, maximum: int, terminal: int | None) -> int:
    """The width to draw at: the content's (``maximum``), unless on a ``terminal`` narrower than that
    which still leaves every word whole (``minimum``: free text wrapped at spaces), then the terminal's.
    A table too wide for the terminal either way keeps one line per row (the terminal folds it)."""
    if terminal is not None and minimum <= terminal < maximum:
        return terminal
    return max(maximum, 1)


def render(renderable: RenderableType, console: Console) -> list[list[Segment]]:
    """The lines of ``renderable`` at :func:`width_for`, trailing spaces cut."""
    natural = Measurement.get(console, console.options.update_width(UNLIMITED), renderable)
    width = width_for(natural.minimum, natural.maximum, console.width if console.is_terminal else None)
    lines = console.render_lines(renderable, console.options.update_width(width), pad=False)
    return [_rstrip(list(line)) for line in lines]


def emit(renderable: RenderableType, console: Console = out) -> None:
    """Print a table or fields (see :func:`render`)."""
    segments: list[Segment] = []
    for line in render(renderable, console):
        segments += [*line, Segment.line()]
    console.print(Segments(segments), end="")
