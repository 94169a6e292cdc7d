"""The store: SQLAlchemy models, migrations and repositories (SQLite by default, PostgreSQL by URL): one
repository module per aggregate, typed rows out (``tables`` says how a new one is shaped).

``Database`` and ``normalize_url`` are imported when first asked for: the package's pure modules (``rows``) are
imported by ``tensora plan`` and the controller's steps, which need no SQLAlchemy to start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensora.store.db import Database, normalize_url

__all__ = ["Database", "normalize_url"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tensora.store import db

        return getattr(db, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
