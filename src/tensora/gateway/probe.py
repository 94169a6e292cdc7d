"""Active health checks of ejected backends, so that traffic is back on a recovered one within seconds.

Live traffic alone is a poor probe: an ejected backend gets one request only when its cooldown ends
(30 s and up), and a failed one ejects it for longer. So every ``interval_s`` (jittered, so that
gateways do not probe in step) each backend whose breaker is open or half-open is asked a cheap
question: ``GET /v1/models`` with the replica's own key (what vLLM answers once its engine is up), or a
peer gateway's ``/healthz`` (its ``/v1/models`` wants the caller's key, which the gateway never keeps).
``Breaker.probed`` closes the breaker after ``probe_successes`` good answers in a row.

httpx rather than the gateway's own upstream client: probes are a few requests a second at most, off
the request path, and may speak TLS to peers.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import httpx

from tensora.gateway.chain import Backend

if TYPE_CHECKING:
    from tensora.gateway.breaker import Breaker
    from tensora.gateway.routes import RouteTable

log = logging.getLogger("tensora.gateway")


def probe_url(b: Backend) -> str:
    if b.peer:
        return b.base_url.removesuffix("/v1") + "/healthz"
    return b.base_url + "/models"


class Probed(Protocol):
    """What the prober reads of a gateway (``proxy.Gateway``): its route table, its backends' breakers, and the
    ejected backends, which it forgets once their breakers close or they leave the route table."""

    @property
    def table(self) -> Callable[[], RouteTable]: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def breakers(self) -> dict[str, Breaker]: ...

    @property
    def ejected(self) -> dict[str, Backend]: ...


class Prober:
    """Probes ``gw``'s ejected backends every ``interval_s`` (``run``), each within ``timeout_s``; counts the
    probes by outcome (the metrics)."""

    def __init__(self, gw: Probed, interval_s: float = 2.0, timeout_s: float = 2.0,
                 jitter: Callable[[], float] = random.random) -> None:
        self.gw, self.interval_s, self.timeout_s, self.jitter = gw, interval_s, timeout_s, jitter
        self._version: str | None = None
        self.rounds = 0
        self.ok = self.failed = 0  # probes by outcome (the metrics)

    def _targets(self) -> list[Backend]:
        """The ejected backends still ejected, and still in the route table (a replica that is gone is
        forgotten, not probed for ever)."""
        gw = self.gw
        table = gw.table()
        if table.version != self._version:
            self._version = table.version
            known = {f"{e.name}/{r.id}": r.url for e in table.endpoints for r in e.replicas}
            for key, b in list(gw.ejected.items()):
                if not b.peer and known.get(key) != b.base_url:
                    del gw.ejected[key]
        out = []
        for key, b in list(gw.ejected.items()):
            br = gw.breakers.get(key)
            if br is None or br.open_until is None:  # closed meanwhile (by a live request)
                del gw.ejected[key]
            else:
                out.append(b)
        return out

    async def _probe(self, client: httpx.AsyncClient, b: Backend) -> bool:
        headers = {"authorization": f"Bearer {b.api_key}"} if b.api_key and not b.peer else {}
        try:
            r = await client.get(probe_url(b), headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def round(self, client: httpx.AsyncClient) -> int:
        """Probe every ejected backend once, at the same time; how many were probed."""
        targets = self._targets()
        if targets:
            results = await asyncio.gather(*(self._probe(client, b) for b in targets))
            now = self.gw.clock()
            good = sum(results)
            self.ok, self.failed = self.ok + good, self.failed + len(results) - good
            for b, ok in zip(targets, results, strict=True):
                br = self.gw.breakers.get(b.key)
                if br is not None:
                    br.probed(now, ok)
                    if br.open_until is None:
                        self.gw.ejected.pop(b.key, None)
        self.rounds += 1
        return len(targets)

    def delay(self) -> float:
        """The wait before the next round: ``interval_s`` less up to a quarter, at random."""
        return self.interval_s * (0.75 + 0.25 * self.jitter())

    async def run(self) -> None:
        async with httpx.AsyncClient(follow_redirects=False) as client:
            while True:
                await asyncio.sleep(self.delay())
                try:
                    await self.round(client)
                except Exception:  # one bad round must not end the probing
                    log.exception("probing ejected backends failed; trying again next round")
