"""The SDK: the retry decision as a table, its invariants as properties, and then the clients
against a real control API behind a fault-injecting proxy (``flaky``): dropped connections,
answers lost on the way back, 503 + Retry-After, 429 + retry-after-ms, an Idempotency-Key in
flight, stalls. Waits go through a fake sleep that records them; nothing here sleeps for real
beyond a proxy's stall."""

from __future__ import annotations

import asyncio
import email.utils
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora import AsyncClient, Client
from tensora.cli import profile
from tensora.control.spec import WorkloadSpec
from tensora.keys.apikeys import digest
from tensora.sdk import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RetryBudget,
    RetryPolicy,
    ServiceUnavailableError,
    UnprocessableError,
    WaitTimeoutError,
    WorkloadEndedError,
)
from tensora.sdk.errors import APIError, for_status
from tensora.sdk.retry import Retry, Stop, decide, retryable, server_wait
from tensora.store import keys as keys_repo
from tests.support import services
from tests.support.clock import FakeClock
from tests.support.doubles import Sleeps
from tests.support.flaky import DROP, LOST, FlakyProxy, flaky, stall, status
from tests.support.stack import T0, Stack, stack

# -- the decision, pure ---------------------------------------------------------------------------

NOW = 1_800_000_000.0
POLICY = RetryPolicy(max_retries=2, base_s=0.5, cap_s=8.0, max_retry_after_s=120.0)


@dataclass(frozen=True)
class Case:
    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    retries_done: int = 0
    want: str = "retry"  # retry | stop
    wait: float | None = None  # the exact wait when the server names it


HTTP_DATE_IN_30S = email.utils.formatdate(NOW + 30, usegmt=True)

CASES = {
    "connection error -> retry": Case(None),
    "408 -> retry": Case(408),
    "429 -> retry": Case(429),
    "500 -> retry": Case(500),
    "503 -> retry": Case(503),
    "504 -> retry": Case(504),
    "400 -> stop": Case(400, want="stop"),
    "401 -> stop": Case(401, want="stop"),
    "404 -> stop": Case(404, want="stop"),
    "422 -> stop": Case(422, want="stop"),
    "409 (a state conflict) -> stop": Case(409, {"retry-after": "1"}, want="stop"),
    "409 in flight (x-should-retry) -> retry": Case(409, {"x-should-retry": "true", "retry-after-ms": "100"},
                                                    wait=0.1),
    "x-should-retry false beats 503": Case(503, {"x-should-retry": "false"}, want="stop"),
    "x-should-retry true beats 400": Case(400, {"x-should-retry": "true"}),
    "retry-after-ms beats retry-after": Case(503, {"retry-after-ms": "250", "retry-after": "9"}, wait=0.25),
    "retry-after in seconds": Case(503, {"retry-after": "3"}, wait=3.0),
    "retry-after as an HTTP date": Case(503, {"retry-after": HTTP_DATE_IN_30S}, wait=30.0),
    "retry-after of 120 s is honoured": Case(429, {"retry-after": "120"}, wait=120.0),
    "retry-after above 120 s -> stop": Case(429, {"retry-after": "121"}, want="stop"),
    "retry-after-ms above 120 s -> stop": Case(503, {"retry-after-ms": "120001"}, want="stop"),
    "unparseable retry-after -> backoff": Case(503, {"retry-after": "soon"}),
    "max_retries reached -> stop": Case(503, retries_done=2, want="stop"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide(case: Case) -> None:
    d = decide(POLICY, case.retries_done, case.status, case.headers, NOW, random.Random(1))
    if case.want == "stop":
        assert isinstance(d, Stop), d
        return
    assert isinstance(d, Retry), d
    if case.wait is not None:
        assert d.delay_s == pytest.approx(case.wait)
    else:
        assert 0 <= d.delay_s <= min(POLICY.cap_s, POLICY.base_s * 2**case.retries_done)


@given(n=st.integers(0, 200), base=st.floats(0, 10), cap=st.floats(0, 60), seed=st.integers(0, 2**32))
def test_backoff_is_full_jitter_within_the_cap(n: int, base: float, cap: float, seed: int) -> None:
    wait = RetryPolicy(base_s=base, cap_s=cap).backoff(n, random.Random(seed))
    assert 0 <= wait <= min(cap, base * 2 ** min(n, 62))


def test_backoff_spreads_over_the_whole_window() -> None:
    rng = random.Random(7)
    waits = [POLICY.backoff(3, rng) for _ in range(2000)]  # window: [0, 4] s
    assert min(waits) < 0.2 and max(waits) > 3.8
    assert 1.8 < sum(waits) / len(waits) < 2.2  # uniform: mean half the window


@given(ms=st.integers(0, 10**7))
def test_retry_after_ms_is_read_in_milliseconds(ms: int) -> None:
    assert server_wait({"retry-after-ms": str(ms)}, NOW) == pytest.approx(ms / 1000)


def test_an_http_date_in_the_past_means_now() -> None:
    assert server_wait({"retry-after": email.utils.formatdate(NOW - 60, usegmt=True)}, NOW) == 0.0


@given(status=st.integers(100, 599))
def test_only_408_429_and_5xx_are_retried_without_a_server_hint(status: int) -> None:
    assert retryable(status, {}) == (status in (408, 429) or status >= 500)


def test_every_status_has_its_exception() -> None:
    want = {401: AuthenticationError, 403: "PermissionDeniedError", 404: NotFoundError, 409: ConflictError,
            422: UnprocessableError, 400: UnprocessableError, 429: RateLimitError, 503: ServiceUnavailableError,
            500: "InternalServerError", 418: APIError}
    for code, cls in want.items():
        got = for_status(code)
        assert (got.__name__ if isinstance(cls, str) else got) == cls, code
        assert issubclass(got, APIError)


def test_the_budget_stops_retries_when_spent_and_refills_with_time_and_successes() -> None:
    clock = FakeClock(0)
    budget = RetryBudget(capacity=3, refund=0.5, per_s=0.1, clock=clock.now)
    assert [budget.spend() for _ in range(4)] == [True, True, True, False]
    budget.success()
    budget.success()  # two successes: one token back
    assert budget.spend() and not budget.spend()
    clock.advance(10)  # 0.1 a second: one more
    assert budget.spend() and not budget.spend()
    clock.advance(10_000)
    assert budget.tokens == 3  # never above capacity


# -- against a real control API -----------------------------------------------------------------

@dataclass
class Api:
    stack: Stack
    url: str


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    s = stack(db_url, tmp_path, run_controller=False)
    with services.serving(s.app) as live:
        try:
            yield Api(s, live.url)
        finally:
            s.services.db.dispose()


@pytest.fixture
def sqlite_api(tmp_path: Path) -> Iterator[Api]:
    s = stack(str(tmp_path / "tensora.db"), tmp_path, run_controller=False)
    with services.serving(s.app) as live:
        try:
            yield Api(s, live.url)
        finally:
            s.services.db.dispose()


def client(url: str, key: str, sleeps: Sleeps, **kw: Any) -> Client:
    kw.setdefault("rng", random.Random(3))
    kw.setdefault("clock", lambda: NOW)
    return Client(key, url, sleep=sleeps, **kw)


def attempts(proxy: FlakyProxy, path: str = "/v1/workloads", method: str = "POST") -> list[dict[str, str]]:
    return [s.headers for s in proxy.seen if s.path == path and s.method == method]


def workloads_of(api: Api, owner: str) -> list[Any]:
    with Client(api.stack.admin, api.url) as admin:
        return [w for w in admin.iter_workloads() if w.owner == owner]


FLAKY_CREATE = [DROP, LOST, status(503, retry_after="1")]


def test_a_flaky_create_is_retried_with_one_idempotency_key_and_makes_exactly_one_workload(api: Api) -> None:
    sleeps = Sleeps()
    with flaky(api.url, *FLAKY_CREATE) as proxy, client(proxy.url, api.stack.alice, sleeps, max_retries=3) as c:
        w = c.create_workload("notebook", "nb", "l40s-48gb", fallback=["cpu"], fallback_after="10m")
    seen = attempts(proxy)
    assert len(seen) == 4
    assert len({h["idempotency-key"] for h in seen}) == 1 and seen[0]["idempotency-key"].startswith("tns_")
    assert [h["x-tensora-attempt"] for h in seen] == ["1", "2", "3", "4"]
    assert len({h["x-request-id"] for h in seen}) == 1
    assert len(sleeps.waits) == 3
    assert 0 <= sleeps.waits[0] <= 0.5 and 0 <= sleeps.waits[1] <= 1.0  # full jitter, then the server's word
    assert sleeps.waits[2] == 1.0
    assert [x.id for x in workloads_of(api, "alice")] == [w.id]  # the lost answer's create was replayed
    assert (w.state, w.gpu_class, w.fallback, w.fallback_after_s) == ("queued", "l40s-48gb", ["cpu"], 600)
    assert w.warning is not None and "JupyterLab runs without a GPU" in w.warning


def test_the_async_client_retries_the_same_way(sqlite_api: Api) -> None:
    api, sleeps = sqlite_api, Sleeps()

    async def go() -> Any:
        async with AsyncClient(api.stack.alice, proxy.url, max_retries=3, sleep=sleeps.async_,
                               rng=random.Random(3), clock=FakeClock(NOW)) as c:
            w = await c.create_workload("notebook", "nb", "l40s-48gb")
            assert (await c.find_workload("nb")).id == w.id and [x.id async for x in c.iter_workloads()] == [w.id]
            return w, await c.get_workload(w.id), await c.list_workloads()

    with flaky(api.url, *FLAKY_CREATE) as proxy:
        w, again, page = asyncio.run(go())
    assert len({h["idempotency-key"] for h in attempts(proxy)}) == 1 and len(attempts(proxy)) == 4
    assert sleeps.waits[2] == 1.0
    assert again.id == w.id and [x.id for x in page.data] == [w.id]


def test_429_waits_retry_after_ms(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with flaky(sqlite_api.url, status(429, retry_after_ms="250", retry_after="7")) as proxy, \
            client(proxy.url, sqlite_api.stack.alice, sleeps) as c:
        assert c.catalog().region == "local"
    assert sleeps.waits == [0.25] and len(attempts(proxy, "/v1/catalog", "GET")) == 2


def test_a_retry_after_as_an_http_date_is_waited_for(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with flaky(sqlite_api.url, status(503, retry_after=HTTP_DATE_IN_30S)) as proxy, \
            client(proxy.url, sqlite_api.stack.alice, sleeps) as c:
        c.usage()
    assert sleeps.waits == [30.0]


def test_a_retry_after_beyond_120s_is_raised_at_once(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with flaky(sqlite_api.url, status(503, retry_after="600")) as proxy, \
            client(proxy.url, sqlite_api.stack.alice, sleeps) as c, pytest.raises(ServiceUnavailableError) as info:
        c.create_workload("notebook", "nb", "l40s-48gb")
    assert info.value.status == 503 and info.value.retry_after == "600"
    assert sleeps.waits == [] and len(attempts(proxy)) == 1
    assert workloads_of(sqlite_api, "alice") == []


def test_a_server_that_says_do_not_retry_is_not_retried(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with flaky(sqlite_api.url, status(503, x_should_retry="false")) as proxy, \
            client(proxy.url, sqlite_api.stack.alice, sleeps) as c, pytest.raises(ServiceUnavailableError):
        c.list_workloads()
    assert len(attempts(proxy, "/v1/workloads", "GET")) == 1


def test_a_real_in_flight_idempotency_conflict_is_retried_then_raised(sqlite_api: Api) -> None:
    """Another request holds the key (its claim is in the store): the server answers 409 with
    x-should-retry and retry-after-ms; the SDK retries that, and only that kind of 409."""
    from tensora.api.idempotency import Claim, fingerprint

    api, sleeps = sqlite_api, Sleeps()
    body = {"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb", "fallback": [], "region": "local"}
    dumped = WorkloadSpec.model_validate(body).model_dump(mode="json")
    with api.stack.services.db.read() as conn:
        alice_key = keys_repo.key_by_digest(conn, digest(api.stack.alice))
    assert alice_key is not None
    claim = Claim({"key_id": alice_key.id, "method": "POST", "path": "/v1/workloads", "key": "mine-1"},
                  fingerprint("POST", "/v1/workloads", dumped))
    assert api.stack.services.idempotency._claim(claim) is None  # in flight now, for 60 s
    with flaky(api.url) as proxy, client(proxy.url, api.stack.alice, sleeps) as c:
        with pytest.raises(ConflictError) as info:
            c.create_workload("notebook", "nb", "l40s-48gb", region="local", idempotency_key="mine-1")
        assert info.value.headers["x-should-retry"] == "true"
        assert "still in progress" in info.value.message
        assert sleeps.waits == [0.1, 0.1] and len(attempts(proxy)) == 3
        assert {h["idempotency-key"] for h in attempts(proxy)} == {"mine-1"}

        w = c.create_workload("vm", "box", "cpu-2c-8g")
        api.stack.controller.run_once()  # placed: a stop now waits for the driver
        assert c.stop_workload(w.id).state == "stopping"
        with pytest.raises(ConflictError) as busy:  # a state conflict, with Retry-After: not retried
            c.restart_workload(w.id)
        assert "stopping" in busy.value.message and busy.value.retry_after == "2"
    assert len(attempts(proxy, f"/v1/workloads/{w.id}/restart")) == 1 and sleeps.waits == [0.1, 0.1]


def test_errors_that_no_retry_fixes_are_raised_at_once_with_status_field_and_request_id(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with client(sqlite_api.url, sqlite_api.stack.alice, sleeps) as c:
        with pytest.raises(UnprocessableError) as bad:
            c.create_workload("notebook", "nb", "no-such-gpu")
        assert bad.value.status == 422 and bad.value.field == "gpu_class" and bad.value.request_id
        assert bad.value.request_id in str(bad.value) and "gpu_class" in str(bad.value)
        with pytest.raises(NotFoundError):
            c.get_workload("wl_nothere")
        with pytest.raises(NotFoundError):
            c.find_workload("nobody-has-this-name")
    with client(sqlite_api.url, "tns_not-a-real-key", sleeps) as c, pytest.raises(AuthenticationError):
        c.list_workloads()
    assert sleeps.waits == []


def test_a_stalled_server_times_out_each_attempt(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with flaky(sqlite_api.url, stall(3), stall(3)) as proxy, \
            client(proxy.url, sqlite_api.stack.alice, sleeps, timeout=0.3, max_retries=1) as c, \
            pytest.raises(APITimeoutError):
        c.list_workloads()
    assert len(attempts(proxy, "/v1/workloads", "GET")) == 2 and len(sleeps.waits) == 1


def test_nobody_listening_is_a_connection_error_after_the_retries() -> None:
    sleeps = Sleeps()
    with client(f"http://127.0.0.1:{services.free_port()}", "k", sleeps) as c, \
            pytest.raises(APIConnectionError) as info:
        c.catalog()
    assert info.value.status is None and len(sleeps.waits) == 2
    assert "cannot reach the control API" in str(info.value) and "k" not in info.value.headers


def test_a_retried_delete_whose_first_answer_was_lost_is_done(sqlite_api: Api) -> None:
    sleeps = Sleeps()
    with client(sqlite_api.url, sqlite_api.stack.alice, sleeps) as c:
        w = c.create_workload("notebook", "nb", "l40s-48gb")
    with flaky(sqlite_api.url, LOST) as proxy, client(proxy.url, sqlite_api.stack.alice, sleeps) as c:
        c.delete_workload(w.id)  # attempt 1 deleted it and lost the 204; attempt 2 finds nothing: done
        assert len(attempts(proxy, f"/v1/workloads/{w.id}", "DELETE")) == 2
        with pytest.raises(NotFoundError):  # a first attempt that finds nothing is still a 404
            c.delete_workload(w.id)
    assert workloads_of(sqlite_api, "alice") == []


def test_the_retry_budget_stops_a_storm(sqlite_api: Api) -> None:
    """An outage: every answer is a 503 that invites a retry. Ten calls with a budget of three
    retries make 13 attempts, not 30; then successes earn retries back."""
    sleeps = Sleeps()
    outage = [status(503, retry_after="0") for _ in range(100)]
    budget = RetryBudget(capacity=3, refund=1.0, per_s=0.0)
    with flaky(sqlite_api.url, *outage) as proxy, \
            client(proxy.url, sqlite_api.stack.alice, sleeps, budget=budget) as c:
        for _ in range(10):
            with pytest.raises(ServiceUnavailableError) as info:
                c.catalog()
        assert len(proxy.seen) == 13 and len(sleeps.waits) == 3
        assert getattr(info.value, "retry_stop", "") == "the client's retry budget is spent"
        proxy.script.clear()  # the outage ends
        c.catalog()
        c.catalog()
        assert budget.tokens == 2
        proxy.then(status(503, retry_after="0"))
        c.catalog()  # retried again
        assert len(proxy.seen) == 17


def test_wait_until_follows_state_and_reason_to_a_fallback(sqlite_api: Api) -> None:
    api = sqlite_api
    clock = api.stack.clock

    def sleep(seconds: float) -> None:  # the controller runs as time passes
        clock.advance(seconds)
        api.stack.controller.run_once()

    seen: list[tuple[str, str]] = []
    with Client(api.stack.admin, api.url, sleep=sleep, clock=clock.now) as admin:
        holder = admin.create_workload("notebook", "holder", "l40s-48gb", owner="carol")
        api.stack.controller.run_once()
        assert admin.get_workload(holder.id).placed_class == "l40s-48gb"
    with Client(api.stack.alice, api.url, sleep=sleep, clock=clock.now) as alice:
        nb = alice.create_workload("notebook", "nb", "l40s-48gb", fallback=["cpu"], fallback_after="10m")
        w = alice.wait_until(nb.id, timeout=3600, poll_s=60, on_change=lambda w: seen.append((w.state, w.reason)))
        assert w.state == "running" and w.placed_class is not None and w.placed_class.startswith("cpu-")
        assert seen[0][0] == "queued" and "l40s-48gb" in seen[0][1]
        assert any(r.startswith(f"placed on {w.placed_class}: l40s-48gb unavailable for 10m") for _, r in seen)
        assert len(seen) == len(set(seen))  # each change once
        assert clock.now() - T0 >= 600

        stuck = alice.create_workload("notebook", "stuck", "l40s-48gb")  # no fallback: waits forever
        with pytest.raises(WaitTimeoutError) as late:
            alice.wait_until(stuck.id, timeout=120, poll_s=30)
        assert late.value.workload.state == "queued"

        alice.stop_workload(stuck.id)
        api.stack.controller.run_once()
        with pytest.raises(WorkloadEndedError) as ended:
            alice.wait_until(stuck.id)
        assert ended.value.workload.state == "stopped"
        assert alice.find_workload("stuck").id == stuck.id


def test_every_route_reads_back_typed(sqlite_api: Api) -> None:
    api = sqlite_api
    with Client(api.stack.alice, api.url) as c:
        w = c.create_workload("notebook", "nb", "l40s-48gb", fallback=["a100-80gb"], fallback_after=0)
        api.stack.controller.run_once()
        assert c.find_workload("nb").id == w.id
        assert [e.to_state for e in c.workload_events(w.id)][:1] == ["queued"]
        assert c.restart_workload(w.id, "requested").placement == "requested"
        assert c.stop_workload(w.id).state in ("stopping", "stopped")
        classes = {x.name: x for x in c.catalog().data}
        assert classes["l40s-48gb"].kind == "gpu" and classes["l40s-48gb"].capacity["local"]["total"] >= 1
        assert c.usage(group_by=["placed_class", "day"]).group_by == ["placed_class", "day"]
        assert c.token_usage().data == []
        k = c.create_key("ci", scopes=["workloads:read"])
        assert k.key is not None and k.scopes == ["workloads:read"]
        assert [x.id for x in c.list_keys() if x.id == k.id] == [k.id]
        assert all(x.key is None for x in c.list_keys())
        c.revoke_key(k.id)
        assert k.id not in [x.id for x in c.list_keys()]
        c.delete_workload(w.id)
        with pytest.raises(NotFoundError):
            c.get_workload(w.id)
        assert c.ready()["status"] == "ready"
        me = c.current_key()
        assert (me.owner, me.admin, "workloads:write" in me.scopes) == ("alice", False, True)
    with Client(api.stack.admin, api.url) as admin:
        assert admin.current_key().admin and admin.current_key().id != me.id


def test_a_key_create_whose_answer_was_lost_is_replayed_without_its_secret(sqlite_api: Api) -> None:
    """The retry of a create whose first answer was lost replays it: the key exists (one key, the same id), and
    the SDK says its secret was withheld instead of handing out a copy kept somewhere."""
    api, sleeps = sqlite_api, Sleeps()
    with flaky(api.url, LOST) as proxy, client(proxy.url, api.stack.alice, sleeps, max_retries=2) as c:
        k = c.create_key("ci", scopes=["workloads:read"])
        assert len(attempts(proxy, "/v1/keys")) == 2
        assert (k.key, k.secret_withheld) == (None, True)
        assert [x.id for x in c.list_keys() if x.name == "ci"] == [k.id]


def test_owners_settings_through_the_sdk(sqlite_api: Api) -> None:
    api = sqlite_api
    with Client(api.stack.admin, api.url) as admin, Client(api.stack.alice, api.url) as alice:
        o = admin.set_owner("alice", quotas={"keys": 2, "storage_bytes": 2**30}, limits={"tokens_per_minute": 5})
        assert (o.quotas.keys, o.limits.tokens_per_minute, o.trusted) == (2, 5, False)
        mine = alice.get_owner("alice")
        assert mine == o and mine.in_use.keys == 1
        alice.create_key("second")
        with pytest.raises(PermissionDeniedError) as full:
            alice.create_key("third")
        assert full.value.type == "quota_exceeded" and full.value.message == "owner quota: 2 of 2 keys in use"
        with pytest.raises(PermissionDeniedError) as refused:
            alice.set_owner("alice", quotas={"keys": 100})
        assert refused.value.status == 403
        o = admin.set_owner("alice", quotas={"keys": None}, trusted=True)
        assert o.overridden == ["quotas.storage_bytes", "limits.tokens_per_minute"] and o.trusted
        assert [x.owner for x in admin.list_owners()] == ["alice"]

    async def main() -> None:
        async with AsyncClient(api.stack.admin, api.url) as admin:
            got = await admin.set_owner("alice", limits={"tokens_per_minute": None})
            assert got.overridden == ["quotas.storage_bytes"]

    asyncio.run(main())


def test_the_client_finds_its_key_as_the_cli_does_and_a_401_says_where_it_looked(
        sqlite_api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api, cfg = sqlite_api, tmp_path / "profiles.json"
    for name in ("TENSORA_API_KEY", "TENSORA_API_URL", "TENSORA_GATEWAY_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TENSORA_CONFIG", str(cfg))
    with Client(base_url=api.url) as c, pytest.raises(AuthenticationError) as nothing:
        c.list_workloads()
    assert "no API key" in str(nothing.value) and str(cfg) in str(nothing.value)
    # the profile `tensora login` saved and made current: its key and its URLs
    profile.save("work", api.url, api.stack.alice, "http://127.0.0.1:8799")
    with Client() as c:
        assert (c.base_url, c.gateway_url) == (api.url, "http://127.0.0.1:8799")
        assert [w.owner for w in c.list_workloads().data] == []
        c.create_workload("notebook", "mine", "l40s-48gb")
        assert [w.owner for w in c.list_workloads().data] == ["alice"]
    # another API's URL: the profile's key is not sent there, and the 401 says why
    with Client(base_url=api.url + "/") as same:
        assert same.api_key == api.stack.alice
    with Client(base_url="http://127.0.0.1:1") as elsewhere:
        assert elsewhere.api_key is None and f"is for {api.url}" in elsewhere.key_source
    # the environment's key wins over the profile's, as in the CLI; a wrong one's 401 names it
    monkeypatch.setenv("TENSORA_API_KEY", "tns_not-a-real-key")
    with Client(base_url=api.url) as c, pytest.raises(AuthenticationError) as wrong:
        c.list_workloads()
    assert "the key came from TENSORA_API_KEY" in str(wrong.value)


@pytest.mark.parametrize(("group_by", "want"), [("placed_class", ["placed_class"]),
                                                ("placed_class,day", ["placed_class", "day"]),
                                                (["owner", "kind"], ["owner", "kind"]),
                                                (("placed_class", "day"), ["placed_class", "day"])],
                         ids=["one name", "names with commas", "a list", "a tuple"])
def test_usage_groups_by_a_name_or_a_list_of_names(sqlite_api: Api, group_by: Any, want: list[str]) -> None:
    with Client(sqlite_api.stack.alice, sqlite_api.url) as c:
        assert c.usage(group_by=group_by).group_by == want


def test_the_openai_helper_points_at_the_gateway_with_this_key() -> None:
    c = Client("tns_abc", "http://127.0.0.1:1", gateway_url="http://127.0.0.1:8701/")
    oa = c.openai(max_retries=0)
    assert str(oa.base_url) == "http://127.0.0.1:8701/v1/" and oa.api_key == "tns_abc"
    c.close()

