"""Running quotas as admission counts them: what one replica of a class counts against its owner
(:func:`share`), each owner's quotas (:class:`OwnerQuotas`), and what each owner holds as a cycle's decisions are
made (:class:`Ledger`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tensora.placement.catalog import Catalog, ComputeClass
from tensora.placement.decisions import Attempt, Outcome, Running
from tensora.placement.quotas import RunningQuotas


@dataclass(frozen=True, slots=True)
class OwnerQuotas:
    """Each owner's running quotas: ``by_owner``, else ``default`` (None: no quota for it). ``held``: what
    each owner's replicas hold now, as (GPUs, vCPUs of CPU classes), starting and stopping ones too; None:
    what ``running`` holds (enough for a caller with no starting or stopping replicas)."""

    default: RunningQuotas | None = None
    by_owner: Mapping[str, RunningQuotas] = field(default_factory=dict)
    held: Mapping[str, tuple[float, float]] | None = None


def share(cls: ComputeClass) -> tuple[float, float]:
    """What one replica of ``cls`` counts against its owner's quotas: (GPUs, vCPUs of a CPU class)."""
    return (0.0, cls.cpu) if cls.is_cpu else (float(cls.gpu_count), 0.0)


class Ledger:
    """What each owner holds as this cycle's decisions are made, checked against its quotas."""

    def __init__(self, quotas: OwnerQuotas | None, running: Sequence[Running], catalog: Catalog) -> None:
        self.quotas = quotas
        self.use: dict[str, list[float]] = {}
        if quotas is None:
            return
        if quotas.held is not None:
            self.use = {o: list(h) for o, h in quotas.held.items()}
            return
        for r in running:
            cls = catalog.get(r.placed_class)
            if cls is not None:
                self.add(r.owner, cls)

    def over(self, owner: str, cls: ComputeClass, entry: str | None = None,
             replaces: ComputeClass | None = None) -> Attempt | None:
        """Why ``cls`` would take ``owner`` past a quota (None: it would not)."""
        if self.quotas is None:
            return None
        quota = self.quotas.by_owner.get(owner, self.quotas.default)
        if quota is None:
            return None
        use = self.use.get(owner, [0.0, 0.0])
        old = share(replaces) if replaces is not None else (0.0, 0.0)
        for i, (need, limit, unit) in enumerate(zip(share(cls), (quota.running_gpus, quota.running_cpu),
                                                    ("GPU", "vCPU"), strict=True)):
            if need > old[i] and use[i] - old[i] + need > limit:
                return Attempt(cls.name, Outcome.OWNER_QUOTA, use[i], need, unit, entry,
                               _quota_text(use[i], limit, need, unit))
        return None

    def recount(self, owner: str, a: Attempt) -> Attempt:
        """An ``OWNER_QUOTA`` attempt with the owner's use now."""
        quota = self.quotas.by_owner.get(owner, self.quotas.default) if self.quotas is not None else None
        if quota is None:
            return a
        i = 0 if a.unit == "GPU" else 1
        limit = (quota.running_gpus, quota.running_cpu)[i]
        used = self.use.get(owner, [0.0, 0.0])[i]
        return Attempt(a.cls, a.outcome, used, a.need, a.unit, a.entry, _quota_text(used, limit, a.need, a.unit))

    def add(self, owner: str, cls: ComputeClass, replaces: ComputeClass | None = None) -> None:
        if self.quotas is None:
            return
        use = self.use.setdefault(owner, [0.0, 0.0])
        old = share(replaces) if replaces is not None else (0.0, 0.0)
        for i, need in enumerate(share(cls)):
            use[i] += need - old[i]


def _quota_text(used: float, limit: float, need: float, unit: str) -> str:
    """``owner quota: 2 of 2 GPUs in use``; ``owner quota: 30 of 32 vCPUs in use, 4 needed`` when some is left."""
    if limit == 0:
        return f"owner quota: no {unit}s allowed"
    text = f"owner quota: {used:g} of {limit:g} {unit}{'' if limit == 1 else 's'} in use"
    return text + (f", {need:g} needed" if used < limit else "")

