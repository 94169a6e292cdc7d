"""What an owner may hold, as the store says: its effective quotas and limits, and the quota check of a create."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import Connection

from tensora.config.quotas import OwnerSettings, effective
from tensora.errors import TensoraError
from tensora.store import keys as keys_repo
from tensora.store import owners as owners_repo
from tensora.store import workloads as workloads_repo


class QuotaExceeded(TensoraError):
    """The owner already holds its quota of what it creates (the API answers 403 ``quota_exceeded``)."""


def settings(conn: Connection, defaults: OwnerSettings, owner: str) -> OwnerSettings:
    """The owner's effective quotas and limits: its stored overrides over the server's defaults."""
    row = owners_repo.get_owner(conn, owner)
    return effective(defaults, row.quotas if row else None, row.limits if row else None)


def check_quota(conn: Connection, defaults: OwnerSettings, owner: str, what: Literal["keys", "workloads"]) -> None:
    """QuotaExceeded when ``owner`` already holds its quota of ``what``. Counted in the transaction that inserts,
    under the owner's quota lock: two creates cannot both take the last slot."""
    owners_repo.lock_owner_quota(conn, owner)
    quota = getattr(settings(conn, defaults, owner).quotas, what)
    held = keys_repo.count_keys(conn, owner) if what == "keys" else workloads_repo.count_workloads(conn, owner)
    if held >= quota:
        raise QuotaExceeded(f"owner quota: {held} of {quota} {what} in use")
