"""The control API's routes as values: what to send and how to read the answer.

``Client`` and ``AsyncClient`` differ only in how they send; both build their requests here, so
a route's path, parameters and response model are written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from tensora.api.schemas import (
    CatalogOut,
    CurrentKeyOut,
    EventList,
    EventOut,
    KeyList,
    KeyOut,
    OwnerList,
    OwnerOut,
    TokenUsageOut,
    UsageOut,
    WorkloadList,
    WorkloadOut,
)

T = TypeVar("T")

Workload = WorkloadOut
Event = EventOut
Key = KeyOut
CurrentKey = CurrentKeyOut
Owner = OwnerOut
Catalog = CatalogOut
Usage = UsageOut
TokenUsage = TokenUsageOut

TERMINAL = ("failed", "stopped")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One logical request. A POST gets an Idempotency-Key (``idempotency_key`` or a fresh one) that
    every retry of it reuses. ``gone_ok``: a retried DELETE that finds nothing was done by an
    earlier attempt whose answer was lost, so a 404 after a retry counts as done."""

    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    idempotency_key: str | None = None
    gone_ok: bool = False


def _none(_: Any) -> None:
    return None


def _id(value: str, what: str) -> str:
    if not value or not isinstance(value, str):
        raise ValueError(f"{what} must be a non-empty string")
    return quote(value, safe="")


def _events(body: Any) -> list[EventOut]:
    return EventList.model_validate(body).data


def _keys(body: Any) -> list[KeyOut]:
    return KeyList.model_validate(body).data


def _params(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def create_workload(kind: str, name: str, gpu_class: str, *, fallback: Sequence[str] = (),
                    fallback_after: str | float | None = None, region: str | None = None,
                    model: str | None = None, replicas: int | None = None,
                    fallback_models: Sequence[str] | None = None, allow_cross_region: bool | None = None,
                    image: str | None = None, spec: dict[str, Any] | None = None, owner: str | None = None,
                    idempotency_key: str | None = None) -> Call[WorkloadOut]:
    body: dict[str, Any] = {"kind": kind, "name": name, "gpu_class": gpu_class, "fallback": list(fallback)}
    optional = {"fallback_after": fallback_after, "region": region, "model": model, "replicas": replicas,
                "fallback_models": list(fallback_models) if fallback_models is not None else None,
                "allow_cross_region": allow_cross_region, "image": image, "spec": spec, "owner": owner}
    body.update({k: v for k, v in optional.items() if v is not None})
    return Call("POST", "/v1/workloads", WorkloadOut.model_validate, json=body, idempotency_key=idempotency_key)


def list_workloads(kind: str | None = None, state: str | None = None, limit: int = 100,
                   after: str | None = None) -> Call[WorkloadList]:
    return Call("GET", "/v1/workloads", WorkloadList.model_validate,
                params=_params(kind=kind, state=state, limit=limit, after=after))


def get_workload(workload_id: str) -> Call[WorkloadOut]:
    return Call("GET", f"/v1/workloads/{_id(workload_id, 'workload_id')}", WorkloadOut.model_validate)


def workload_events(workload_id: str) -> Call[list[EventOut]]:
    return Call("GET", f"/v1/workloads/{_id(workload_id, 'workload_id')}/events", _events)


def stop_workload(workload_id: str, idempotency_key: str | None = None) -> Call[WorkloadOut]:
    return Call("POST", f"/v1/workloads/{_id(workload_id, 'workload_id')}/stop", WorkloadOut.model_validate,
                idempotency_key=idempotency_key)


def restart_workload(workload_id: str, placement: str = "policy",
                     idempotency_key: str | None = None) -> Call[WorkloadOut]:
    return Call("POST", f"/v1/workloads/{_id(workload_id, 'workload_id')}/restart", WorkloadOut.model_validate,
                json={"placement": placement}, idempotency_key=idempotency_key)


def delete_workload(workload_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/workloads/{_id(workload_id, 'workload_id')}", _none, gone_ok=True)


def catalog() -> Call[CatalogOut]:
    return Call("GET", "/v1/catalog", CatalogOut.model_validate)


def usage(group_by: str | Iterable[str] = ("placed_class",), since: float | None = None, until: float | None = None,
          owner: str | None = None) -> Call[UsageOut]:
    """``group_by``: one dimension (``"placed_class"``), several comma-separated, or a list of them."""
    groups = group_by if isinstance(group_by, str) else ",".join(group_by)
    return Call("GET", "/v1/usage", UsageOut.model_validate,
                params=_params(group_by=groups, since=since, until=until, owner=owner))


def token_usage(since: float | None = None, until: float | None = None) -> Call[TokenUsageOut]:
    return Call("GET", "/v1/usage/tokens", TokenUsageOut.model_validate, params=_params(since=since, until=until))


def create_key(name: str = "key", *, scopes: Sequence[str] | None = None, owner: str | None = None,
               requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
               idempotency_key: str | None = None) -> Call[KeyOut]:
    body = _params(name=name, scopes=list(scopes) if scopes is not None else None, owner=owner,
                   requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute)
    return Call("POST", "/v1/keys", KeyOut.model_validate, json=body, idempotency_key=idempotency_key)


def current_key() -> Call[CurrentKeyOut]:
    return Call("GET", "/v1/keys/current", CurrentKeyOut.model_validate)


def list_keys() -> Call[list[KeyOut]]:
    return Call("GET", "/v1/keys", _keys)


def revoke_key(key_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/keys/{_id(key_id, 'key_id')}", _none, gone_ok=True)


def get_owner(owner: str) -> Call[OwnerOut]:
    return Call("GET", f"/v1/owners/{_id(owner, 'owner')}", OwnerOut.model_validate)


def list_owners() -> Call[list[OwnerOut]]:
    return Call("GET", "/v1/owners", lambda body: OwnerList.model_validate(body).data)


def set_owner(owner: str, *, trusted: bool | None = None, quotas: Mapping[str, Any] | None = None,
              limits: Mapping[str, Any] | None = None) -> Call[OwnerOut]:
    """A PUT of what is given only: a quota or limit set to None goes back to the server's default. The same
    body twice is the same state, so it is retried like a GET."""
    body = _params(trusted=trusted, quotas=dict(quotas) if quotas is not None else None,
                   limits=dict(limits) if limits is not None else None)
    return Call("PUT", f"/v1/owners/{_id(owner, 'owner')}", OwnerOut.model_validate, json=body)


def ready() -> Call[dict[str, Any]]:
    return Call("GET", "/readyz", dict)


@dataclass(slots=True)
class Watch:
    """What ``wait_until`` has seen: it reports a workload when its state or reason changes."""

    states: tuple[str, ...]
    last: tuple[str, str] | None = None

    def changed(self, w: WorkloadOut) -> bool:
        now = (w.state, w.reason)
        if now == self.last:
            return False
        self.last = now
        return True

    def done(self, w: WorkloadOut) -> bool:
        return w.state in self.states

    def ended(self, w: WorkloadOut) -> bool:
        return w.state in TERMINAL and w.state not in self.states


def pick_by_name(name: str, found: list[WorkloadOut]) -> WorkloadOut | None:
    """The one workload called ``name``; None if none; ValueError naming the ids if several."""
    matches = [w for w in found if w.name == name]
    if len(matches) > 1:
        live = [w for w in matches if w.state not in TERMINAL]
        if len(live) == 1:
            return live[0]
        ids = ", ".join(w.id for w in matches)
        raise ValueError(f"{len(matches)} workloads are called {name!r} ({ids}): give the id")
    return matches[0] if matches else None
