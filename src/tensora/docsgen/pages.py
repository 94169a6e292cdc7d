"""The generated reference pages (``docs/reference/``) and the check that the committed ones are current.

The pages are rendered from the code itself (the CLI's typer app, the control API's OpenAPI document, the settings'
models, the metrics' collectors), so they cannot say what the code does not; a test renders them again and fails
while a committed page differs (``python -m tensora.docsgen`` writes them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tensora.docsgen import cli, httpapi, metrics, settings

COMMAND = "python -m tensora.docsgen"
PAGES: dict[str, Callable[[], str]] = {
    "cli.md": cli.render,
    "http-api.md": httpapi.render,
    "configuration.md": settings.render,
    "metrics.md": metrics.render,
}


def default_dir() -> Path:
    """docs/reference of the source tree this module is in (a checkout: src/tensora/docsgen)."""
    return Path(__file__).resolve().parents[3] / "docs" / "reference"


def render() -> dict[str, str]:
    """Each page's name and text, ending in one newline."""
    return {name: page().rstrip("\n") + "\n" for name, page in PAGES.items()}


def write(out: Path) -> list[Path]:
    """Write every page into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in render().items():
        path = out / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


def stale(committed: Path) -> list[str]:
    """The pages under ``committed`` that differ from what the code renders now (or are missing)."""
    found = []
    for name, content in render().items():
        path = committed / name
        if not path.is_file() or path.read_text(encoding="utf-8") != content:
            found.append(name)
    return found
