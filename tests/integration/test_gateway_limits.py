"""Rate limits per owner across all its keys: an owner's keys share one window, a key may be held lower but
never higher, and the headers report the tighter window. The pure decision as a table, the limiters
(memory and a real Redis) against each other as a property, and the attack over HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensora.gateway.limits import Admission, Caller, Limiter, MemoryLimiter, Quota, RedisLimiter, Refused, decide
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable, table_from_json
from tensora.keys import apikeys
from tests.support.clock import FakeClock
from tests.support.gateway_harness import Backends, backends_fixture, chat, make_table, replica, serving
from tests.support.services import redis_server

pytestmark = pytest.mark.timeout(180)

MID_MINUTE = 1_800_000_030.0  # the windows are wall-clock minutes: hold the clock 30 s into one


# -- the decision, pure ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    caller: Caller
    used: list[tuple[int, int]]  # (requests, tokens) so far in each window: owner's, then key's
    tokens: int
    ok: bool
    reason: Refused | None = None
    scope: str = ""
    reported: tuple[int, int, int, int] = (0, 0, 0, 0)  # limit and used: requests, then tokens


OWNER = Quota(10, 1000)
CASES = {
    "owner only, room -> admitted, the owner's window reported":
        Case(Caller("a", OWNER), [(3, 100)], 50, True, reported=(10, 4, 1000, 150)),
    "owner only, requests full -> refused by the owner":
        Case(Caller("a", OWNER), [(10, 100)], 50, False, Refused.REQUESTS, "owner", (10, 10, 1000, 100)),
    "owner's tokens short -> refused by the owner though the key has room":
        Case(Caller("a", OWNER, "k", Quota(5, 900)), [(3, 960), (0, 0)], 50, False, Refused.TOKENS, "owner",
             (5, 0, 1000, 960)),
    "key held lower and full -> refused by the key, its window reported":
        Case(Caller("a", OWNER, "k", Quota(2, 1000)), [(5, 0), (2, 0)], 1, False, Refused.REQUESTS, "key",
             (2, 2, 1000, 0)),
    "key lower in requests only -> requests from the key, tokens from the owner":
        Case(Caller("a", OWNER, "k", Quota(4, 1000)), [(1, 500), (1, 10)], 10, True, reported=(4, 2, 1000, 510)),
    "the owner has less left than the key's lower limit -> the owner's reported":
        Case(Caller("a", OWNER, "k", Quota(4, 1000)), [(8, 0), (1, 0)], 1, True, reported=(10, 9, 1000, 1)),
    "as much left in both -> the lower limit reported":
        Case(Caller("a", OWNER, "k", Quota(4, 1000)), [(6, 0), (0, 0)], 1, True, reported=(4, 1, 1000, 1)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide(case: Case) -> None:
    adm = decide(case.caller, case.used, case.tokens, 7, 30.0)
    assert (adm.ok, adm.reason, adm.scope) == (case.ok, case.reason, case.scope)
    assert (adm.quota.rpm, adm.requests, adm.quota.tpm, adm.tokens) == case.reported
    assert adm.reserved == (case.tokens if case.ok else 0)


# -- the limiters: memory and Redis make the same decisions, and no key widens its owner's window -----------

@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


KEY_QUOTAS = [None, Quota(3, 400), Quota(100, 100_000)]  # key 2 asks for more than its owner: held to it
# (which key, tokens reserved, tokens used, 1: a minute passes first)
ops = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 300), st.integers(0, 300), st.sampled_from([0, 0, 0, 1])),
               max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_memory_and_redis_admit_alike_and_no_key_passes_its_owner(redis_url: str,
                                                                   ops: list[tuple[int, int, int, int]]) -> None:
    owner = Quota(6, 1000)

    def caller(k: int) -> Caller:
        q = KEY_QUOTAS[k]
        held = None if q is None else Quota(min(q.rpm, owner.rpm), min(q.tpm, owner.tpm))
        return Caller("alice", owner, f"key_{k}", held)

    minutes = [sum(op[3] for op in ops[:i + 1]) for i in range(len(ops))]  # the clock only moves on

    async def run(lim: Limiter) -> list[Admission]:
        seen = []
        try:
            for (k, tokens, used, _), minute in zip(ops, minutes, strict=True):
                adm = await lim.admit(caller(k), tokens, MID_MINUTE + 60 * minute)
                if adm.ok:
                    await lim.settle(adm, used)
                seen.append(adm)
        finally:
            await lim.close()
        return seen

    mem = asyncio.run(run(MemoryLimiter()))
    red = asyncio.run(run(RedisLimiter(redis_url, f"p{time.monotonic_ns()}", timeout_s=2, connect_timeout_s=2)))
    assert [(a.ok, a.requests, a.tokens, a.quota) for a in mem] == [(a.ok, a.requests, a.tokens, a.quota)
                                                                    for a in red]
    for minute in set(minutes):
        admitted = [(op[0], a) for op, a, m in zip(ops, mem, minutes, strict=True) if a.ok and m == minute]
        assert len(admitted) <= owner.rpm
        assert sum(1 for k, _ in admitted if k == 1) <= 3


# -- the attack over HTTP: many keys of one owner share its limit --------------------------------------------

ALICE_1, ALICE_2, ALICE_LOW, BOB = (apikeys.generate() for _ in range(4))
KEYS = {k: (o, ["inference"]) for k, o in ((ALICE_1, "alice"), (ALICE_2, "alice"), (ALICE_LOW, "alice"),
                                           (BOB, "bob"))}


backends = backends_fixture(["r1"])


def gateway(table: RouteTable, limiter: Limiter | None = None, **opts: int) -> Gateway:
    return Gateway(Options(ttft_s=2, deadline_s=5, **opts), lambda: table, limiter or MemoryLimiter(), None,
                   wall=FakeClock(MID_MINUTE))


def endpoints(b: Backends) -> list[dict[str, object]]:
    return [{"id": "wl_a", "name": "my-llm", "owner": "alice", "replicas": [replica("r1", b.url("r1"))]},
            {"id": "wl_b", "name": "my-llm", "owner": "bob", "replicas": [replica("r1", b.url("r1"))]}]


def post(url: str, key: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=chat(**kw), headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


@pytest.mark.parametrize("source", ["owners list", "gateway default"])
def test_two_keys_of_one_owner_get_the_owners_limit_only_in_total(backends: Backends, source: str) -> None:
    owners = {"alice": (4, 100_000), "bob": (4, 100_000)} if source == "owners list" else {}
    table = make_table(endpoints(backends), KEYS, owners=owners)
    with serving(gateway(table, rpm=4 if source == "gateway default" else 600)) as url:
        codes = [post(url, key).status_code for key in [ALICE_1, ALICE_2] * 5]
        bob = post(url, BOB)  # another owner's window is his own
    assert codes == [200] * 4 + [429] * 6
    assert bob.status_code == 200


def test_a_key_may_be_held_lower_than_its_owner_never_higher(backends: Backends) -> None:
    # ALICE_1 asks for 100 a minute: held to alice's 5; ALICE_LOW is held to 2 of alice's 5
    table = make_table(endpoints(backends), KEYS, owners={"alice": (5, 100_000)},
                       limits={ALICE_1: (100, None), ALICE_LOW: (2, 50)})
    with serving(gateway(table)) as url:
        low = [post(url, ALICE_LOW, max_tokens=10) for _ in range(3)]
        big = post(url, ALICE_LOW, max_tokens=60)
        high = [post(url, ALICE_1) for _ in range(4)]
    assert [r.status_code for r in low] == [200, 200, 429]
    # the tighter window in the headers: the key's 2 requests, its 50 tokens
    assert [r.headers["x-ratelimit-remaining-requests"] for r in low[:2]] == ["1", "0"]
    assert low[0].headers["x-ratelimit-limit-requests"] == "2" and low[0].headers["x-ratelimit-limit-tokens"] == "50"
    assert "this key's own limit" in low[2].json()["error"]["message"]
    assert big.status_code == 400 and big.json()["error"]["param"] == "max_tokens"  # over the key's 50 tokens
    assert "this key's own tokens_per_minute (50)" in big.json()["error"]["message"]
    assert [r.status_code for r in high] == [200, 200, 200, 429]  # 2 + 3 = alice's 5, not 100
    assert high[0].headers["x-ratelimit-limit-requests"] == "5"
    assert high[0].headers["x-ratelimit-remaining-requests"] == "2"
    assert "shared by all of this owner's keys" in high[3].json()["error"]["message"]


def test_two_gateways_sharing_redis_hold_the_owners_limit_across_its_keys(backends: Backends, redis_url: str) -> None:
    table = make_table(endpoints(backends), KEYS, owners={"alice": (6, 100_000)})
    prefix = f"t{time.monotonic_ns()}"
    with (serving(gateway(table, RedisLimiter(redis_url, prefix, timeout_s=2))) as a,
          serving(gateway(table, RedisLimiter(redis_url, prefix, timeout_s=2))) as b):
        codes = [post(url, key).status_code for url, key in [(a, ALICE_1), (b, ALICE_2)] * 5]
    assert codes == [200] * 6 + [429] * 4


# -- the route table's owners ---------------------------------------------------------------------------------

def owners_row(**kw: object) -> dict[str, object]:
    return {"owner": "alice", "requests_per_minute": 60, "tokens_per_minute": 5000, **kw}


@pytest.mark.parametrize(("rows", "want"), [
    (None, {}),  # a control API from before owners' limits: the gateway's defaults apply
    ([], {}),
    ([owners_row()], {"alice": (60, 5000)}),
    ([owners_row(), owners_row(owner="bob", requests_per_minute=1)], {"alice": (60, 5000), "bob": (1, 5000)}),
], ids=["absent", "empty", "one", "two"])
def test_owners_in_the_route_table(rows: list[dict[str, object]] | None, want: dict[str, tuple[int, int]]) -> None:
    doc = {"version": "1", "keys": [], "endpoints": [], **({"owners": rows} if rows is not None else {})}
    got = table_from_json(doc).owners
    assert {o: (r.rpm, r.tpm) for o, r in got.items()} == want


@pytest.mark.parametrize("bad", [owners_row(requests_per_minute=0), owners_row(tokens_per_minute="many"),
                                 owners_row(requests_per_minute=True), owners_row(requests_per_minute=None)],
                         ids=["zero", "a string", "a boolean", "null"])
def test_a_broken_owners_row_is_refused_not_read_as_no_limit(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="owners"):  # the gateway keeps the table it has
        table_from_json({"version": "1", "keys": [], "endpoints": [], "owners": [bad]})
