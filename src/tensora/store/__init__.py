"""The store: SQLAlchemy models, migrations and repositories (SQLite by default, PostgreSQL by URL)."""

from tensora.store.db import Database, normalize_url

__all__ = ["Database", "normalize_url"]
