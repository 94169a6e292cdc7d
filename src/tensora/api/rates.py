"""Per-owner rates of the control API's costly calls: workload creates (and restarts), deletes, file uploads.

Each costs the controller, the driver or the disk far more than a read, so one owner's churn (1,932 create and
delete cycles in 20 s) could slow every other owner's. Past its limit a call is 429 with Retry-After, before any
work is done; calls are counted in the store (``owner_calls``) over the last :data:`WINDOW_S`, so the count
holds across API processes and restarts. The caller's own owner is counted (an admin acting for another
owner spends the admin's). Attempts count, a refused one does not: a create rejected as invalid still read
its body and the model's headers. A retry of a POST whose Idempotency-Key the server already holds (a replay,
or a duplicate while the first runs) is neither counted nor refused: it costs a lookup and runs nothing.
"""

from __future__ import annotations

import math
from enum import StrEnum

from tensora.api.errors import ApiError
from tensora.api.owners import owner_settings
from tensora.api.services import Services
from tensora.config.quotas import RATE_WINDOW_S as WINDOW_S
from tensora.store import idempotency as idempotency_repo
from tensora.store import rates as rates_repo


class Action(StrEnum):
    """A counted call; its value is the ``owner_calls.action`` stored."""

    CREATE = "create"
    DELETE = "delete"
    UPLOAD = "upload"


_LIMIT = {Action.CREATE: ("creates_per_minute", "workload creates and restarts"),
          Action.DELETE: ("deletes_per_minute", "workload deletes"),
          Action.UPLOAD: ("uploads_per_minute", "file uploads")}


def take(svc: Services, owner: str, action: Action, retry_of: dict[str, str] | None = None) -> None:
    """Count one ``action`` call of ``owner``; 429 with Retry-After (nothing counted) when it is over its limit.
    ``retry_of``: the idempotency record's key of a POST that sent an Idempotency-Key (key_id, method, path,
    key); a call whose record exists is not counted."""
    field, what = _LIMIT[action]
    with svc.db.write() as conn:
        if retry_of is not None and idempotency_repo.get_idempotency(conn, retry_of) is not None:
            return
        limit = getattr(owner_settings(conn, svc, owner).limits, field)
        wait = rates_repo.take_call(conn, owner, action.value, svc.clock.now(), limit, WINDOW_S)
    if wait is not None:
        retry = max(1, math.ceil(wait))
        raise ApiError(429, f"too many {what}: at most {limit} a minute for this owner (limits.{field}); "
                            f"retry in {retry} s", retry_after=retry)
