"""The fallback chain of ADR-0010 part B as a pure plan: which backends to try, in which order.

1. the endpoint's own replicas (its requested class, or any class that is not a CPU fallback);
2. its CPU replicas, when it accepts CPU fallback;
3. the serverless shared pool for the same model, when that model is in the curated catalog;
4. its ``fallback_models``, in order;
5. peer regions' gateways, only with ``allow_cross_region`` (and never for a request that already
   hopped, so two regions cannot bounce a request between them);
6. nothing left: the walk answers 503 with Retry-After (``Plan.retry_after``).

A backend whose breaker is open is left out at once and listed in ``Plan.skipped``; one that said
in its 429 not to be sent requests before a time, in ``Plan.limited``. Within a tier the replicas
are rotated by ``turn`` so that load spreads. A request too long for the model (``longer_context``)
goes on to the fallback models only. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tensora.gateway.routes import EndpointRoute, RouteTable


class ServedBy(StrEnum):
    REPLICA = "replica"
    CPU = "cpu"
    SERVERLESS = "serverless"
    FALLBACK_MODEL = "fallback-model"


@dataclass(frozen=True, slots=True)
class Backend:
    key: str  # what X-Tensora-Attempts names it by: "<endpoint>/<replica>" or "peer:<region>"
    base_url: str  # ends in /v1
    upstream_model: str | None  # the ``model`` sent upstream (None: the endpoint has none, sent as null)
    model: str  # the public name of the model that answers: what the response's ``model`` says
    served_by: ServedBy
    endpoint_id: str  # whose tokens these are (accounting): the endpoint, pool or fallback model
    region: str
    ttft_s: float | None = None
    peer: bool = False
    api_key: str | None = None  # a replica's own key (the walk sends it as Authorization); None for peers
    stream_idle_s: float | None = None  # the endpoint's own limit on a stream's silence after its first token
    context: int | None = None  # its model's context length in tokens, when known


@dataclass(frozen=True, slots=True)
class Peer:
    region: str
    url: str  # the peer gateway's base URL, ending in /v1


@dataclass(frozen=True, slots=True)
class Plan:
    attempts: tuple[Backend, ...]
    skipped: tuple[Backend, ...]  # breaker open
    retry_after: float | None  # the soonest time a skipped or limited backend takes requests again
    limited: tuple[Backend, ...] = ()  # rate limited by the backend's own 429, until its Retry-After


def _rotate(items: Sequence[Backend], turn: int) -> list[Backend]:
    if not items:
        return []
    k = turn % len(items)
    return [*items[k:], *items[:k]]


def _replicas(e: EndpointRoute, served_by: ServedBy, *, cpu: bool | None, model: str) -> list[Backend]:
    return [Backend(f"{e.name}/{r.id}", r.url, r.upstream_model, model, served_by, e.id, e.region, e.ttft_s,
                    api_key=r.api_key, stream_idle_s=e.stream_idle_s, context=e.context)
            for r in e.replicas if cpu is None or r.cpu == cpu]


def tiers(endpoint: EndpointRoute, table: RouteTable, peers: Sequence[Peer], *,
          hopped: bool) -> list[list[Backend]]:
    """Every backend the chain allows, tier by tier, before rotation and breakers. It depends only on
    the route table, so the walk keeps it per table version (``walk.Walk``)."""
    e = endpoint
    if e.requested_cpu:  # a CPU endpoint's replicas are its own class, not a fallback
        own, cpu = _replicas(e, ServedBy.REPLICA, cpu=None, model=e.name), []
    else:
        own = _replicas(e, ServedBy.REPLICA, cpu=False, model=e.name)
        cpu = _replicas(e, ServedBy.CPU, cpu=True, model=e.name) if e.cpu_fallback else []
    pool: list[Backend] = []
    if not e.serverless and e.model:
        for s in table.serverless_by_model.get(e.model, ()):
            pool += _replicas(s, ServedBy.SERVERLESS, cpu=None, model=s.name)
    fallbacks: list[list[Backend]] = []
    for name in e.fallback_models:
        f = table.resolve(e.owner, name)
        if f is not None and f.id != e.id:
            fallbacks.append(_replicas(f, ServedBy.FALLBACK_MODEL, cpu=None, model=f.name))
    remote: list[Backend] = []
    if e.allow_cross_region and not hopped:
        remote = [Backend(f"peer:{p.region}", p.url, e.name, e.name, ServedBy.REPLICA, e.id, p.region, e.ttft_s,
                          peer=True, stream_idle_s=e.stream_idle_s, context=e.context)
                  for p in peers if p.region != e.region]
    return [own, cpu, pool, *fallbacks, remote]


def plan(endpoint: EndpointRoute, table: RouteTable, peers: Sequence[Peer], open_until: Callable[[str], float | None],
         *, hopped: bool = False, turn: int = 0) -> Plan:
    """The attempts in order. ``open_until(key)``: when that backend's open breaker lets a probe
    through again, or None when it takes requests now (closed, or half-open)."""
    return order(tiers(endpoint, table, peers, hopped=hopped), open_until, turn)


def order(all_tiers: Sequence[Sequence[Backend]], open_until: Callable[[str], float | None], turn: int = 0,
          limited_until: Callable[[str], float | None] | None = None) -> Plan:
    """Rotate each tier by ``turn`` (the peers' tier stays in its configured order), then leave out
    the backends whose breakers are open, and those rate limited (``limited_until(key)``: until when)."""
    attempts: list[Backend] = []
    skipped: list[Backend] = []
    limited: list[Backend] = []
    soonest: float | None = None
    last = len(all_tiers) - 1
    for i, tier in enumerate(all_tiers):
        for b in (tier if i == last else _rotate(tier, turn)):
            until = open_until(b.key)
            out = skipped
            if until is None and limited_until is not None:
                until, out = limited_until(b.key), limited
            if until is None:
                attempts.append(b)
            else:
                out.append(b)
                soonest = until if soonest is None else min(soonest, until)
    return Plan(tuple(attempts), tuple(skipped), soonest, tuple(limited))


def longer_context(remaining: Sequence[Backend], failed: Backend) -> list[Backend]:
    """What is left to try after ``failed`` said the request is longer than its model's context: the
    same model cannot take it anywhere (its other replicas, CPU, the pool, peers), so only the fallback
    models, those other than the one that said so: those whose known context is larger than the failed
    model's first (largest first), then the rest in their listed order (a context no config states is not
    known to be smaller)."""
    left = [b for b in remaining if b.served_by is ServedBy.FALLBACK_MODEL and b.endpoint_id != failed.endpoint_id]
    return sorted(left, key=lambda b: -b.context if b.context and b.context > (failed.context or 0) else 0)


def too_small(backends: Sequence[Backend], least: int) -> tuple[list[Backend], list[Backend]]:
    """(those whose known context can hold ``least`` tokens or is unknown, those known too small for it):
    a request that cannot fit a model's context is not sent to it (it would only answer 400)."""
    fits: list[Backend] = []
    small: list[Backend] = []
    for b in backends:
        (small if b.context is not None and least > b.context else fits).append(b)
    return fits, small
