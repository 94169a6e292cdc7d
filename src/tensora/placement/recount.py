"""A wait's figures as of the end of a cycle (:class:`Recount`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensora.placement.capacity import Capacity
from tensora.placement.decisions import Attempt, Outcome, Wait
from tensora.placement.owner_quotas import Ledger


class Recount:
    """A wait's figures as of the end of a cycle: the free GPUs, vCPUs or memory of each class it found full, the
    requesters still waiting for each class held from it, its owner's quota use.

    Within a cycle those figures move as workloads are placed; a wait shows the last of them, so every wait
    of a region (and of an owner) shows the same, and a state kept across cycles
    (:mod:`tensora.placement.admission_state`) can keep its waits and recount them when a figure moves."""

    def __init__(self, cap: Capacity, ledger: Ledger, waiting_for: Mapping[tuple[str, str], int]) -> None:
        self.cap, self.ledger, self.waiting_for = cap, ledger, waiting_for
        self.done: dict[tuple[int, str, str], tuple[Attempt, Attempt]] = {}
        # (a tuple, its region, "") -> (the tuple, recounted; None: it holds an owner's quota, so see owned)
        self.lists: dict[tuple[int, str, str], tuple[tuple[Attempt, ...], tuple[Attempt, ...] | None]] = {}
        self.owned: dict[tuple[int, str, str], tuple[tuple[Attempt, ...], tuple[Attempt, ...]]] = {}

    def wait(self, d: Wait) -> Wait:
        w = d.workload
        attempts = self.attempts(d.attempts, w.region, w.owner)
        return d if attempts == d.attempts else Wait(w, attempts, d.fallback_eligible_at, d.now)

    def attempts(self, attempts: Sequence[Attempt], region: str, owner: str) -> tuple[Attempt, ...]:
        """``attempts`` recounted; a tuple (shared by many waits: ``SharedAttempts``) is recounted once per
        region (and owner, if it holds an owner's quota), and kept with its answer so that its id is not
        reused meanwhile."""
        if type(attempts) is not tuple:
            return self._each(attempts, region, owner)
        key = (id(attempts), region, "")
        done = self.lists.get(key)
        if done is None:
            mine = any(a.outcome is Outcome.OWNER_QUOTA for a in attempts)
            done = self.lists[key] = (attempts, None if mine else self._each(attempts, region, owner))
        if done[1] is not None:
            return done[1]
        key = (id(attempts), region, owner)
        owned = self.owned.get(key)
        if owned is None:
            owned = self.owned[key] = (attempts, self._each(attempts, region, owner))
        return owned[1]

    def _each(self, attempts: Sequence[Attempt], region: str, owner: str) -> tuple[Attempt, ...]:
        return tuple([self.attempt(a, region, owner) for a in attempts])

    def attempt(self, a: Attempt, region: str, owner: str) -> Attempt:
        outcome = a.outcome
        if outcome is not Outcome.NO_CAPACITY and outcome is not Outcome.HELD_FOR_REQUESTERS \
                and outcome is not Outcome.OWNER_QUOTA:
            return a
        # by identity: the waits of a cycle share their attempts (``SharedAttempts``), and hashing one by value
        # costs more than recounting it; ``a`` is kept with its answer, so its id is not reused meanwhile
        key = (id(a), region, owner if outcome is Outcome.OWNER_QUOTA else "")
        done = self.done.get(key)
        if done is None:
            done = self.done[key] = (a, self._recount(a, region, owner))
        return done[1]

    def _recount(self, a: Attempt, region: str, owner: str) -> Attempt:
        # Attempt(...) rather than dataclasses.replace: a cycle recounts every wait it decides, and replace
        # costs several times as much
        if a.outcome is Outcome.HELD_FOR_REQUESTERS:
            detail = f"{self.waiting_for.get((region, a.cls), 0)} waiting"
            return a if detail == a.detail else Attempt(a.cls, a.outcome, a.free, a.need, a.unit, a.entry, detail)
        cls = self.cap.catalog.get(a.cls)
        if cls is None:
            return a
        if a.outcome is Outcome.NO_CAPACITY:
            free = self.cap.free(region, cls)
            return Attempt(a.cls, a.outcome, free.free, free.need, free.unit, a.entry, a.detail)
        return self.ledger.recount(owner, a)

