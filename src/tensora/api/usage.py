"""Usage: accounted time by class, owner, kind and day; tokens the gateways served."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from tensora.api.deps import ERRORS, Svc, UsageReader, iso
from tensora.api.errors import ApiError
from tensora.api.schemas import TokenUsageOut, UsageOut
from tensora.control.usage import summarize
from tensora.store import usage as usage_repo

router = APIRouter()


@router.get("/v1/usage", response_model=UsageOut, responses=ERRORS, tags=["usage"],
            description="Accounted time (no prices: Tensora is free), summed by placed_class, and by owner, "
                        "kind and UTC day on request (group_by=placed_class,owner,day).")
def usage(svc: Svc, p: UsageReader,
          group_by: Annotated[str, Query(pattern=r"^(placed_class|owner|day|kind)(,(placed_class|owner|day|kind))*$")]
          = "placed_class",
          since: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
          until: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
          owner: Annotated[str | None, Query(max_length=128, description="admin keys only")] = None,
          ) -> dict[str, Any]:
    now = svc.clock.now()
    start, end = since or 0.0, min(until or now, now)
    if owner is not None and owner != p.owner and not p.is_admin:
        raise ApiError(403, "only admin keys may read another owner's usage", field="owner")
    who = owner if owner is not None else p.owner_filter()
    keys = list(dict.fromkeys(group_by.split(",")))
    with svc.db.read() as conn:
        segments = usage_repo.segments(conn, who, start, end)
    rows = summarize(segments, keys, start, end)
    return {"since": iso(start), "until": iso(end), "group_by": keys, "data": rows,
            "total_seconds": round(sum(r["seconds"] for r in rows), 3)}


@router.get("/v1/usage/tokens", response_model=TokenUsageOut, responses=ERRORS, tags=["usage"],
            description="Tokens the gateway served, by endpoint, product (the endpoint's own replicas, the "
                        "serverless pool, a fallback model, another region), model that answered and served_by.")
def usage_tokens(svc: Svc, p: UsageReader,
                 since: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
                 until: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
                 ) -> dict[str, Any]:
    now = svc.clock.now()
    start = since or 0.0
    with svc.db.read() as conn:  # no until: everything metered so far (a gateway's clock may run ahead)
        rows = usage_repo.token_usage(conn, p.owner_filter(), start, until)
    return {"since": iso(start), "until": iso(until if until is not None else now), "data": [r._asdict() for r in rows]}
