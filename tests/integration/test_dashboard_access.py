"""What a notebook's or VM's page says under Access when there is nowhere to reach it: why (not started yet,
stopping, stopped, failed), and how to start it again. The dashboard over HTTP, on the simulated fleet."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tensora.sdk import Client
from tests.support.dashboard import live, signed_in
from tests.support.stack import Stack

__all__ = ["live"]  # the fixture, shared


def _stop(s: Stack, sdk: Client, wid: str) -> None:
    sdk.stop_workload(wid)
    s.controller.run_once()
    s.controller.run_once()


def _fail(s: Stack, sdk: Client, wid: str) -> None:
    (replica,) = [r for r in s.driver.specs() if r.workload_id == wid]
    s.driver.fail(replica.id, "QEMU exited with code 1")
    s.controller.run_once()


def _queue(s: Stack, sdk: Client, wid: str) -> None:
    sdk.stop_workload(wid)
    s.controller.run_once()
    s.controller.run_once()
    sdk.restart_workload(wid, "policy")  # queued until the controller's next cycle


@dataclass(frozen=True)
class Case:
    then: Callable[[Stack, Client, str], None]
    state: str
    says: str


CASES = {
    "stopped -> says so, and how to start it again": Case(
        _stop, "stopped", "Stopped: start it again with Restart below, or tensora workloads restart box."),
    "failed -> says so, and how to start it again": Case(
        _fail, "failed", "Failed: start it again with Restart below, or tensora workloads restart box."),
    "queued again -> not running yet": Case(_queue, "queued", "Not running yet."),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_vm_with_nowhere_to_reach_says_why_and_how_to_start_it(live: tuple[Stack, str], case: Case) -> None:
    s, url = live
    with Client(s.alice, url) as sdk:
        wid = sdk.create_workload("vm", "box", "cpu-2c-8g").id
        s.controller.run_once()
        s.controller.run_once()
        assert sdk.get_workload(wid).state == "running"
        case.then(s, sdk, wid)
        assert sdk.get_workload(wid).state == case.state
    with signed_in(url, s.alice) as dash:
        page = dash.get(f"/ui/workloads/{wid}").text
    card = re.search(r'<h2 id="access-h">Access</h2>(.*?)</section>', page, re.S)
    assert card is not None, page
    text = html.unescape(re.sub(r"<[^>]+>", "", card.group(1))).strip()
    assert text == case.says
