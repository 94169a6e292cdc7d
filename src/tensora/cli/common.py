"""What every ``tensora`` command shares: the app, output options, and errors as exit codes.

Exit codes (the README lists them too):

    0  ok
    1  the API answered with an error (the message says which, and its request id)
    2  bad usage, or a bad file or value (the message names it)
    3  a timeout: ``--wait`` passed its ``--timeout``, or the API did not answer in time
    4  the API could not be reached
    5  the workload failed or stopped while ``--wait`` waited for it to run
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

OK, API_ERROR, USAGE, TIMEOUT, UNREACHABLE, ENDED = 0, 1, 2, 3, 4, 5

app = typer.Typer(help="Tensora: a free GPU cloud with opt-in, explicit and visible fallbacks.",
                  no_args_is_help=True, add_completion=False)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Output = Annotated[str, typer.Option("--output", "-o", help="table or json")]


def fail(exc: Exception | str, code: int = USAGE) -> typer.Exit:
    sys.stderr.write(f"error: {exc}\n")  # plain, unwrapped: scripts and people grep it
    return typer.Exit(code)


def check_output(output: str) -> None:
    if output not in ("table", "json"):
        raise fail(f"--output must be table or json, not {output!r}")
