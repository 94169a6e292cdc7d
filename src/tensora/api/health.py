"""Health: the process is up (healthz), the database answers (readyz)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from tensora.api.deps import Svc
from tensora.api.schemas import ErrorOut

router = APIRouter()


@router.get("/healthz", tags=["health"], description="The process is up.")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["health"], responses={503: {"model": ErrorOut}},
            description="The database answers and the server is not shutting down.")
def readyz(svc: Svc) -> JSONResponse:
    svc.db.ping()
    return JSONResponse({"status": "ready", "region": svc.region,
                         "controller": svc.controller_state()})
