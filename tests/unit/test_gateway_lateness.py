"""``upstream.Lateness``: the upstream heads' timeouts on one loop timer, not one a request. A head is failed with
``TimeoutError`` once its time has passed, never before, never after it came or was given up on; an earlier one
added later is still on time. Real event loops, timeouts of tens of milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from tensora.gateway.upstream import Lateness

LOOPS: dict[str, Callable[[Any], Any]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


def outcome(f: asyncio.Future[None]) -> str:
    if not f.done():
        return "waiting"
    return "late" if isinstance(f.exception(), TimeoutError) else "came"


@pytest.mark.parametrize("run", LOOPS.values(), ids=LOOPS.keys())
def test_each_head_is_late_at_its_own_time_and_only_if_it_has_not_come(run: Callable[[Any], Any]) -> None:
    async def go() -> list[dict[str, str]]:
        loop = asyncio.get_running_loop()
        lateness = Lateness()
        heads = {name: loop.create_future() for name in ("slow", "quick", "came", "given up")}
        lateness.add(loop, heads["slow"], 0.4)
        lateness.add(loop, heads["quick"], 0.05)  # earlier than the timer set for "slow": set again
        lateness.add(loop, heads["came"], 0.05)
        lateness.add(loop, heads["given up"], 0.05)
        heads["came"].set_result(None)
        lateness.remove(heads["came"])
        lateness.remove(heads["given up"])  # the request was cancelled: nobody waits on its head any more
        seen = []
        for wait in (0.02, 0.13, 0.45):
            await asyncio.sleep(wait)
            seen.append({name: outcome(f) for name, f in heads.items()})
        return seen

    assert run(go()) == [
        {"slow": "waiting", "quick": "waiting", "came": "came", "given up": "waiting"},
        {"slow": "waiting", "quick": "late", "came": "came", "given up": "waiting"},
        {"slow": "late", "quick": "late", "came": "came", "given up": "waiting"},
    ]


def test_no_timer_is_left_set_once_nothing_is_awaited() -> None:
    async def go() -> tuple[Any, int]:
        loop = asyncio.get_running_loop()
        lateness = Lateness()
        head = loop.create_future()
        lateness.add(loop, head, 0.02)
        await asyncio.sleep(0.06)
        return lateness.timer, len(lateness.due)

    assert uvloop.run(go()) == (None, 0)


def test_a_client_used_on_a_second_loop_still_times_its_heads_out() -> None:
    lateness = Lateness()

    async def go(timeout: float, wait: float) -> str:
        loop = asyncio.get_running_loop()
        head = loop.create_future()
        lateness.add(loop, head, timeout)
        await asyncio.sleep(wait)
        return outcome(head)

    assert asyncio.run(go(0.3, 0.05)) == "waiting"  # its timer, set for later, dies with that loop
    assert asyncio.run(go(0.35, 0.45)) == "late"  # later than that timer was: a timer of its own all the same
