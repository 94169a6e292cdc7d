"""``Client`` and ``AsyncClient``: every control API route as a typed method, with safe retries.

    from tensora import Client
    with Client() as tensora:   # TENSORA_API_URL, TENSORA_API_KEY, else the profile `tensora login` saved
        nb = tensora.create_workload("notebook", "nb", "l40s-48gb", fallback=["cpu"], fallback_after="10m")
        nb = tensora.wait_until(nb.id, timeout=900, on_change=lambda w: print(w.state, w.reason))

Failed attempts are retried as ``retry`` decides (see its docstring), within one ``RetryBudget``
per client. Each logical POST carries one Idempotency-Key on all its attempts, so a create whose
answer was lost is not done twice. Every attempt sends ``X-Tensora-Attempt: n`` (1-based) and
the one ``X-Request-Id`` of its logical call.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

import httpx

from tensora import __version__
from tensora.api.schemas import WorkloadList
from tensora.sdk import calls
from tensora.sdk.calls import Call, Catalog, CurrentKey, Event, Key, Owner, TokenUsage, Usage, Workload
from tensora.sdk.errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    NotFoundError,
    WaitTimeoutError,
    WorkloadEndedError,
    for_status,
)
from tensora.sdk.profiles import config_path, current_profile
from tensora.sdk.retry import RetryBudget, RetryPolicy, Stop, decide
from tensora.storage import FileList, FileOut

T = TypeVar("T")

DEFAULT_API_URL = "http://127.0.0.1:8700"
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8701"
ATTEMPT_HEADER = "X-Tensora-Attempt"


@dataclass(frozen=True)
class _Settings:
    api_key: str | None
    api_url: str
    gateway_url: str
    key_source: str
    """Where the key came from (or where none was found), said in a 401's message."""


def _find_settings(api_key: str | None, api_url: str | None, gateway_url: str | None,
                   env: Mapping[str, str]) -> _Settings:
    """Each setting from the argument, else ``TENSORA_*`` in the environment, else the CLI's current profile (the
    one ``tensora login`` saved last), else the one-machine default: the CLI's order. The profile's key is taken
    only with its own API URL (none given, or the same one), so it is never sent to another server."""
    url = api_url or env.get("TENSORA_API_URL")
    gateway = gateway_url or env.get("TENSORA_GATEWAY_URL")
    if api_key is not None:
        key, source = api_key, "the key came from the api_key argument"
    elif env.get("TENSORA_API_KEY"):
        key, source = env["TENSORA_API_KEY"], "the key came from TENSORA_API_KEY"
    else:
        key = None
        saved = current_profile()
        same_api = saved is not None and (url is None or url.rstrip("/") == (saved.api_url or "").rstrip("/"))
        if saved is not None and saved.api_key and same_api:
            key, source = saved.api_key, f"the key came from profile {saved.name!r} in {saved.path}"
            url, gateway = url or saved.api_url, gateway or saved.gateway_url
        else:
            where = (f"profile {saved.name!r} in {saved.path} is for {saved.api_url}" if saved is not None
                     and saved.api_key else f"no profile with a key in {config_path()}")
            source = f"no API key: none passed as api_key, TENSORA_API_KEY is unset, and {where}; run tensora login"
    return _Settings(key, (url or DEFAULT_API_URL).rstrip("/"), (gateway or DEFAULT_GATEWAY_URL).rstrip("/"),
                     source)


class _Base:
    """What both clients share: settings, headers, reading answers, and the retry decision."""

    def __init__(self, api_key: str | None, base_url: str | None, *, timeout: float, max_retries: int,
                 policy: RetryPolicy | None, budget: RetryBudget | None, rng: random.Random | None,
                 clock: Callable[[], float], gateway_url: str | None) -> None:
        found = _find_settings(api_key, base_url, gateway_url, os.environ)
        self.api_key, self.base_url, self.gateway_url = found.api_key, found.api_url, found.gateway_url
        self.key_source = found.key_source
        self.policy = policy or RetryPolicy(max_retries=max_retries)
        self.budget = budget or RetryBudget(clock=clock)
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 5.0))
        self._rng = rng or random.Random()
        self._clock = clock

    def _headers(self, attempt: int, idempotency_key: str | None, request_id: str) -> dict[str, str]:
        h = {"User-Agent": f"tensora-sdk/{__version__}", ATTEMPT_HEADER: str(attempt), "X-Request-Id": request_id}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if idempotency_key is not None:
            h["Idempotency-Key"] = idempotency_key
        return h

    def _start(self, call: Call[Any]) -> tuple[str | None, str]:
        key = call.idempotency_key or (f"tns_{uuid.uuid4().hex}" if call.method == "POST" else None)
        return key, "req_" + secrets.token_hex(8)

    def _read(self, call: Call[T], response: httpx.Response, retries: int) -> T:
        """The parsed answer; an APIError for an error status (or a body that is not what the route returns)."""
        rid = response.headers.get("x-request-id")
        if response.status_code == 404 and call.gone_ok and retries > 0:
            self.budget.success()
            return call.parse(None)
        if response.status_code >= 400:
            error = self._status_error(response, rid)
            if response.status_code == 401:
                error.message = f"{error.message} ({self.key_source})"
            raise error
        if response.status_code == 204:
            self.budget.success()
            return call.parse(None)
        try:
            value = call.parse(response.json())
        except ValueError as exc:  # not JSON, or not the shape of this route's answer
            raise APIError(f"unexpected answer from {call.method} {call.path}: {str(exc)[:300]}",
                           status=response.status_code, request_id=rid) from None
        self.budget.success()
        return value

    @staticmethod
    def _status_error(response: httpx.Response, rid: str | None) -> APIError:
        try:
            body: Any = response.json()
        except ValueError:
            body = None
        detail = body.get("error") if isinstance(body, dict) else None
        message = detail.get("message") if isinstance(detail, dict) else None
        if not isinstance(message, str):
            message = response.text[:300] or response.reason_phrase
        cls = for_status(response.status_code)
        return cls(message, status=response.status_code, body=body, request_id=rid,
                   headers={k.lower(): v for k, v in response.headers.items()})

    def _transport_error(self, exc: httpx.HTTPError, request_id: str) -> APIError:
        if isinstance(exc, httpx.TimeoutException):
            return APITimeoutError(f"no answer from the control API at {self.base_url} in time ({type(exc).__name__})",
                                   request_id=request_id)
        return APIConnectionError(f"cannot reach the control API at {self.base_url}: {exc or type(exc).__name__}",
                                  request_id=request_id)

    def _delay(self, retries: int, error: APIError) -> float | None:
        """Seconds to wait before the next attempt, or None to raise ``error`` now."""
        d = decide(self.policy, retries, error.status, error.headers, self._clock(), self._rng)
        if isinstance(d, Stop):
            error.retry_stop = d.why  # type: ignore[attr-defined]
            return None
        if not self.budget.spend():
            error.retry_stop = "the client's retry budget is spent"  # type: ignore[attr-defined]
            return None
        return d.delay_s

    def _watch_deadline(self, states: Iterable[str], timeout: float) -> tuple[calls.Watch, float]:
        if timeout < 0:
            raise ValueError("timeout must not be negative")
        return calls.Watch(tuple(states)), self._clock() + timeout

    def _watch_step(self, watch: calls.Watch, w: Workload, deadline: float,
                    on_change: Callable[[Workload], Any] | None) -> float | None:
        """After a poll: None when done; raises when it cannot be; else how long to sleep."""
        if watch.changed(w) and on_change is not None:
            on_change(w)
        if watch.done(w):
            return None
        if watch.ended(w):
            raise WorkloadEndedError(f"workload {w.name} ({w.id}) is {w.state}: {w.reason}", w)
        left = deadline - self._clock()
        if left <= 0:
            raise WaitTimeoutError(f"workload {w.name} ({w.id}) is still {w.state} after the timeout: {w.reason}", w)
        return left

    def _not_found(self, ref: str) -> NotFoundError:
        return NotFoundError(f"no workload {ref!r}", status=404)


class Client(_Base):
    """The control API, synchronously. Thread-safe; close it (or use ``with``) when done."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *, timeout: float = 30.0,
                 max_retries: int = 2, policy: RetryPolicy | None = None, budget: RetryBudget | None = None,
                 rng: random.Random | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time, gateway_url: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(api_key, base_url, timeout=timeout, max_retries=max_retries, policy=policy, budget=budget,
                         rng=rng, clock=clock, gateway_url=gateway_url)
        self._sleep = sleep
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def run(self, call: Call[T]) -> T:
        """Send ``call``, retrying as the policy and the budget allow."""
        idem, rid = self._start(call)
        retries = 0
        while True:
            try:
                response = self._http.request(call.method, call.path, params=call.params or None, json=call.json,
                                              headers=self._headers(retries + 1, idem, rid))
                return self._read(call, response, retries)
            except (httpx.HTTPError, APIError) as exc:
                error = self._transport_error(exc, rid) if isinstance(exc, httpx.HTTPError) else exc
            delay = self._delay(retries, error)
            if delay is None:
                raise error
            self._sleep(delay)
            retries += 1

    # -- workloads --------------------------------------------------------------------

    def create_workload(self, kind: str, name: str, gpu_class: str, *, fallback: Sequence[str] = (),
                        fallback_after: str | float | None = None, **more: Any) -> Workload:
        """Create a notebook, vm or endpoint. ``more``: region, model, replicas, fallback_models,
        allow_cross_region, image, spec, owner, idempotency_key (see ``calls.create_workload``)."""
        return self.run(calls.create_workload(kind, name, gpu_class, fallback=fallback,
                                              fallback_after=fallback_after, **more))

    def list_workloads(self, kind: str | None = None, state: str | None = None, limit: int = 100,
                       after: str | None = None) -> WorkloadList:
        """One page; pass ``after=page.next`` for the next (``iter_workloads`` follows them)."""
        return self.run(calls.list_workloads(kind, state, limit, after))

    def iter_workloads(self, kind: str | None = None, state: str | None = None) -> Iterable[Workload]:
        after = None
        while True:
            page = self.list_workloads(kind, state, 500, after)
            yield from page.data
            if page.next is None:
                return
            after = page.next

    def get_workload(self, workload_id: str) -> Workload:
        return self.run(calls.get_workload(workload_id))

    def find_workload(self, ref: str) -> Workload:
        """By id (``wl_...``) or by name; a name that several workloads share is a ValueError."""
        if ref.startswith("wl_"):
            return self.get_workload(ref)
        found = calls.pick_by_name(ref, list(self.iter_workloads()))
        if found is None:
            raise self._not_found(ref)
        return found

    def workload_events(self, workload_id: str) -> list[Event]:
        return self.run(calls.workload_events(workload_id))

    def stop_workload(self, workload_id: str, *, idempotency_key: str | None = None) -> Workload:
        return self.run(calls.stop_workload(workload_id, idempotency_key))

    def restart_workload(self, workload_id: str, placement: str = "policy", *,
                         idempotency_key: str | None = None) -> Workload:
        """``placement="requested"``: back on the requested class only (the 'restart on GPU' offer)."""
        return self.run(calls.restart_workload(workload_id, placement, idempotency_key))

    def delete_workload(self, workload_id: str) -> None:
        self.run(calls.delete_workload(workload_id))

    def wait_until(self, workload_id: str, states: Iterable[str] = ("running",), timeout: float = 600.0, *,
                   poll_s: float = 1.0, on_change: Callable[[Workload], Any] | None = None) -> Workload:
        """Poll until the workload is in one of ``states``; ``on_change`` hears each new state or reason.
        Raises WorkloadEndedError if it fails or stops first, WaitTimeoutError after ``timeout``."""
        watch, deadline = self._watch_deadline(states, timeout)
        while True:
            w = self.get_workload(workload_id)
            left = self._watch_step(watch, w, deadline, on_change)
            if left is None:
                return w
            self._sleep(min(poll_s, left))

    # -- catalog, usage, keys -------------------------------------------------------------

    def catalog(self) -> Catalog:
        return self.run(calls.catalog())

    def usage(self, group_by: str | Iterable[str] = ("placed_class",), since: float | None = None,
              until: float | None = None, owner: str | None = None) -> Usage:
        return self.run(calls.usage(group_by, since, until, owner))

    def token_usage(self, since: float | None = None, until: float | None = None) -> TokenUsage:
        return self.run(calls.token_usage(since, until))

    def create_key(self, name: str = "key", **more: Any) -> Key:
        """``more``: scopes, owner, requests_per_minute, tokens_per_minute (admin keys), idempotency_key.
        The secret is in ``key``, once: a replay of the create (a retry whose first answer was lost) has
        ``key`` None and ``secret_withheld`` True; the key exists, and only revoking it helps."""
        return self.run(calls.create_key(name, **more))

    def current_key(self) -> CurrentKey:
        """This client's key: its id, owner, scopes, and whether it is an admin key."""
        return self.run(calls.current_key())

    def list_keys(self) -> list[Key]:
        return self.run(calls.list_keys())

    def revoke_key(self, key_id: str) -> None:
        self.run(calls.revoke_key(key_id))

    def get_owner(self, owner: str) -> Owner:
        return self.run(calls.get_owner(owner))

    def list_owners(self) -> list[Owner]:
        return self.run(calls.list_owners())

    def set_owner(self, owner: str, *, trusted: bool | None = None, quotas: Mapping[str, Any] | None = None,
                  limits: Mapping[str, Any] | None = None) -> Owner:
        """Admin keys: mark ``owner`` trusted (its new pods run without Kata on Kubernetes) or untrusted again,
        and override some of its quotas (keys, workloads, running_gpus, running_cpu, storage_bytes) and gateway
        limits (requests_per_minute, tokens_per_minute); what is not given keeps its value, a field given as
        None goes back to the server's default. ``get_owner`` reads them back, effective."""
        return self.run(calls.set_owner(owner, trusted=trusted, quotas=quotas, limits=limits))

    def ready(self) -> dict[str, Any]:
        return self.run(calls.ready())

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client for this key on the region's gateway (``model`` = endpoint name)."""
        import openai

        return openai.OpenAI(base_url=f"{self.gateway_url}/v1", api_key=self.api_key, **kwargs)

    # -- files ------------------------------------------------------------------------

    def upload_file(self, local_path: str | os.PathLike[str], name: str, *,
                    on_progress: Callable[[int], Any] | None = None) -> FileOut:
        """Upload one file to your storage as ``name`` (e.g. ``tiny/model.safetensors``), streamed from
        disk; ``on_progress(sent)`` hears how many of its bytes are sent so far. Retried as any call
        (a PUT of the same bytes to the same name is idempotent), reading the file again from its start."""
        path = Path(local_path)
        call: Call[FileOut] = Call("PUT", self._file_path(name), FileOut.model_validate)
        rid = "req_" + secrets.token_hex(8)
        retries = 0
        while True:
            try:
                with path.open("rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    headers = {**self._headers(retries + 1, None, rid), "Content-Length": str(size),
                               "Content-Type": "application/octet-stream"}
                    response = self._http.request("PUT", call.path, content=self._file_chunks(f, on_progress),
                                                  headers=headers)
                return self._read(call, response, retries)
            except (httpx.HTTPError, APIError) as exc:
                error = self._transport_error(exc, rid) if isinstance(exc, httpx.HTTPError) else exc
            delay = self._delay(retries, error)
            if delay is None:
                raise error
            self._sleep(delay)
            retries += 1

    def upload_dir(self, local_dir: str | os.PathLike[str], name: str, *,
                   on_progress: Callable[[int], Any] | None = None) -> list[FileOut]:
        """Upload every file under ``local_dir`` as ``name/<its relative path>`` (a model directory);
        see ``local_files`` for which. ``on_progress(sent)`` hears the bytes of all of them sent so far."""
        done, out = 0, []
        for path, rel in self.local_files(local_dir):
            def progress(sent: int, base: int = done) -> None:
                if on_progress is not None:
                    on_progress(base + sent)

            out.append(self.upload_file(path, f"{name.rstrip('/')}/{rel}", on_progress=progress))
            done += out[-1].size
        return out

    @staticmethod
    def local_files(local_dir: str | os.PathLike[str]) -> list[tuple[Path, str]]:
        """The files ``upload_dir`` sends, as (path, relative POSIX name), by name: regular files and
        links to them; hidden files and directories (``.git``, ``.cache``) are left out, as are links
        to directories."""
        top = Path(local_dir)
        if not top.is_dir():
            raise ValueError(f"{top} is not a directory")
        found = []
        for here, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for f in files:
                path = Path(here) / f
                if not f.startswith(".") and path.is_file():
                    found.append((path, path.relative_to(top).as_posix()))
        return sorted(found, key=lambda pr: pr[1])

    @staticmethod
    def _file_path(name: str) -> str:
        """``/v1/files/<name>``, each segment percent-encoded, dots of ``.``/``..`` segments too: the
        server refuses those (422 naming them), and unencoded they would be resolved away in the URL."""
        segments = name.split("/")
        return "/v1/files/" + "/".join(seg.replace(".", "%2E") if seg in (".", "..") else quote(seg, safe="")
                                       for seg in segments)

    @staticmethod
    def _file_chunks(f: IO[bytes], on_progress: Callable[[int], Any] | None,
                     size: int = 1 << 20) -> Iterator[bytes]:
        sent = 0
        while chunk := f.read(size):
            yield chunk
            sent += len(chunk)
            if on_progress is not None:
                on_progress(sent)

    def list_files(self, prefix: str | None = None) -> FileList:
        """Your files (those under ``prefix`` if given), with the bytes they take and your quota."""
        params = {"prefix": prefix} if prefix is not None else {}
        return self.run(Call("GET", "/v1/files", FileList.model_validate, params=params))

    def delete_file(self, name: str) -> FileList:
        """Delete the file ``name``, or every file under ``name/`` (a model directory); returns what went."""
        return self.run(Call("DELETE", self._file_path(name), FileList.model_validate))


async def _asleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


class AsyncClient(_Base):
    """The control API for asyncio code: the same methods as ``Client``, awaited."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *, timeout: float = 30.0,
                 max_retries: int = 2, policy: RetryPolicy | None = None, budget: RetryBudget | None = None,
                 rng: random.Random | None = None, sleep: Callable[[float], Awaitable[None]] = _asleep,
                 clock: Callable[[], float] = time.time, gateway_url: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(api_key, base_url, timeout=timeout, max_retries=max_retries, policy=policy, budget=budget,
                         rng=rng, clock=clock, gateway_url=gateway_url)
        self._sleep = sleep
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def run(self, call: Call[T]) -> T:
        idem, rid = self._start(call)
        retries = 0
        while True:
            try:
                response = await self._http.request(call.method, call.path, params=call.params or None,
                                                    json=call.json, headers=self._headers(retries + 1, idem, rid))
                return self._read(call, response, retries)
            except (httpx.HTTPError, APIError) as exc:
                error = self._transport_error(exc, rid) if isinstance(exc, httpx.HTTPError) else exc
            delay = self._delay(retries, error)
            if delay is None:
                raise error
            await self._sleep(delay)
            retries += 1

    async def create_workload(self, kind: str, name: str, gpu_class: str, *, fallback: Sequence[str] = (),
                              fallback_after: str | float | None = None, **more: Any) -> Workload:
        return await self.run(calls.create_workload(kind, name, gpu_class, fallback=fallback,
                                                    fallback_after=fallback_after, **more))

    async def list_workloads(self, kind: str | None = None, state: str | None = None, limit: int = 100,
                             after: str | None = None) -> WorkloadList:
        return await self.run(calls.list_workloads(kind, state, limit, after))

    async def iter_workloads(self, kind: str | None = None, state: str | None = None) -> AsyncIterator[Workload]:
        after = None
        while True:
            page = await self.list_workloads(kind, state, 500, after)
            for w in page.data:
                yield w
            if page.next is None:
                return
            after = page.next

    async def get_workload(self, workload_id: str) -> Workload:
        return await self.run(calls.get_workload(workload_id))

    async def find_workload(self, ref: str) -> Workload:
        if ref.startswith("wl_"):
            return await self.get_workload(ref)
        found = calls.pick_by_name(ref, [w async for w in self.iter_workloads()])
        if found is None:
            raise self._not_found(ref)
        return found

    async def workload_events(self, workload_id: str) -> list[Event]:
        return await self.run(calls.workload_events(workload_id))

    async def stop_workload(self, workload_id: str, *, idempotency_key: str | None = None) -> Workload:
        return await self.run(calls.stop_workload(workload_id, idempotency_key))

    async def restart_workload(self, workload_id: str, placement: str = "policy", *,
                               idempotency_key: str | None = None) -> Workload:
        return await self.run(calls.restart_workload(workload_id, placement, idempotency_key))

    async def delete_workload(self, workload_id: str) -> None:
        await self.run(calls.delete_workload(workload_id))

    async def wait_until(self, workload_id: str, states: Iterable[str] = ("running",), timeout: float = 600.0, *,
                         poll_s: float = 1.0, on_change: Callable[[Workload], Any] | None = None) -> Workload:
        watch, deadline = self._watch_deadline(states, timeout)
        while True:
            w = await self.get_workload(workload_id)
            left = self._watch_step(watch, w, deadline, on_change)
            if left is None:
                return w
            await self._sleep(min(poll_s, left))

    async def catalog(self) -> Catalog:
        return await self.run(calls.catalog())

    async def usage(self, group_by: str | Iterable[str] = ("placed_class",), since: float | None = None,
                    until: float | None = None, owner: str | None = None) -> Usage:
        return await self.run(calls.usage(group_by, since, until, owner))

    async def token_usage(self, since: float | None = None, until: float | None = None) -> TokenUsage:
        return await self.run(calls.token_usage(since, until))

    async def create_key(self, name: str = "key", **more: Any) -> Key:
        return await self.run(calls.create_key(name, **more))

    async def current_key(self) -> CurrentKey:
        """This client's key: its id, owner, scopes, and whether it is an admin key."""
        return await self.run(calls.current_key())

    async def list_keys(self) -> list[Key]:
        return await self.run(calls.list_keys())

    async def revoke_key(self, key_id: str) -> None:
        await self.run(calls.revoke_key(key_id))

    async def get_owner(self, owner: str) -> Owner:
        return await self.run(calls.get_owner(owner))

    async def list_owners(self) -> list[Owner]:
        return await self.run(calls.list_owners())

    async def set_owner(self, owner: str, *, trusted: bool | None = None, quotas: Mapping[str, Any] | None = None,
                        limits: Mapping[str, Any] | None = None) -> Owner:
        return await self.run(calls.set_owner(owner, trusted=trusted, quotas=quotas, limits=limits))

    async def ready(self) -> dict[str, Any]:
        return await self.run(calls.ready())

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client for this key on the region's gateway."""
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.gateway_url}/v1", api_key=self.api_key, **kwargs)
