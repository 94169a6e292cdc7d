"""The documentation site's reference pages, generated from the code (``python -m tensora.docsgen``)."""

from tensora.docsgen.pages import COMMAND, PAGES, default_dir, render, stale, write

__all__ = ["COMMAND", "PAGES", "default_dir", "render", "stale", "write"]
