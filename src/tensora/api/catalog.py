"""The catalog: each class with its free and total capacity in this region."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tensora.api.deps import ERRORS, Reader, Svc
from tensora.api.schemas import CatalogOut
from tensora.placement.attempts import SharedAttempts
from tensora.placement.capacity import Capacity, Placed
from tensora.placement.decisions import shortage
from tensora.store import nodes as nodes_repo
from tensora.store import workloads as workloads_repo
from tensora.units import format_memory

router = APIRouter()


@router.get("/v1/catalog", response_model=CatalogOut, responses=ERRORS, tags=["catalog"])
def catalog(svc: Svc, _: Reader) -> dict[str, Any]:
    with svc.db.read() as conn:
        node_rows = nodes_repo.nodes_in(conn, svc.region)
        placed = [Placed(r.node, r.cls, r.workload_id) for r in workloads_repo.active_replicas(conn, svc.region)]
    nodes = [n.node() for n in node_rows]
    now = Capacity(nodes, placed, svc.catalog, svc.reserves)
    free = {c.cls: c.fits for c in now.summary(svc.region)}
    full = SharedAttempts(now)
    total = {c.cls: c.fits for c in Capacity(nodes, [], svc.catalog, svc.reserves).summary(svc.region)}
    data = []
    for cls in svc.catalog.values():
        gpu = ({"model": cls.gpu_model, "count": cls.gpu_count, "memory": format_memory(cls.gpu_memory)}
               if cls.gpu_model else None)
        data.append({"name": cls.name, "kind": cls.kind.value, "cpu": cls.cpu, "memory": format_memory(cls.memory),
                     "disk": format_memory(cls.disk),
                     "gpu": gpu, "capacity": {svc.region: {"free": free.get(cls.name, 0),
                                                           "total": total.get(cls.name, 0)}},
                     "short": {} if free.get(cls.name, 0) or not nodes
                     else {svc.region: shortage(full.full(svc.region, cls))}})
    return {"region": svc.region, "data": data, "isolation": svc.isolation,
            "note": "cpu classes have no GPU: endpoints on them serve roughly 10-50x slower than on a GPU "
                    "class, notebooks and VMs run without one; 'cpu' in a fallback list means the cpu class "
                    "nearest the requested size that has room"}
