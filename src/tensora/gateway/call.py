"""What the three parts of the request path share: the edge (``proxy``: the key, the limits, the body), the
walk (``walk``: tiers, breakers, retries) and the relay (``relay``: the answer, whole or streamed).

``Call`` is one request on its way, made once by the edge; ``Served`` what answered it; ``Failed`` an attempt
that did not work out, for the walk to move on from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from tensora.gateway.breaker import Policy
from tensora.gateway.chain import Backend, Peer
from tensora.gateway.routes import EndpointRoute, KeyRoute, RouteTable

if TYPE_CHECKING:
    from tensora.gateway.limits import Admission

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = (b"content-type", b"application/json")
HOP = b"x-tensora-hop"


@dataclass
class Options:
    region: str = "local"
    ttft_s: float = 30.0  # per attempt: until the first token (streams) or the response head
    deadline_s: float = 120.0  # per request, all attempts together
    stream_idle_s: float = 30.0  # after the first token: the longest a stream may go without an event
    retry_delay_s: float = 0.1  # before the one retry of a tier's only backend (jittered 0.5x-1.5x)
    retry_room_s: float = 1.0  # the retry goes only when this much of the deadline is left after the delay
    connect_timeout_s: float = 2.0
    retry_after_s: int = 5  # a 503 with no breaker to wait for
    rpm: int = 600  # an owner's limits (all its keys together) when the route table does not list the owner
    tpm: int = 1_000_000
    default_max_tokens: int = 256  # reserved when a request gives no max_tokens
    max_body_bytes: int = 8 << 20
    max_upstream_body_bytes: int = 32 << 20  # a model server's whole answer: 502 beyond
    max_sse_event_bytes: int = 1 << 20  # one event of its stream: the stream ends with an error event beyond
    breaker: Policy = field(default_factory=Policy)
    rate_limit_backoff_s: float = 1.0  # a backend's 429 without Retry-After: skip it this long (x0.5-1.5)
    peers: tuple[Peer, ...] = ()


@dataclass(slots=True, init=False)
class Call:
    """One request on its way: what every step of the walk and the relay needs of it, made once by the edge
    rather than handed down through each signature. ``attempts`` grows as the walk goes (X-Tensora-Attempts);
    ``deadline`` is set when the walk starts.

    Its ``__init__`` is written out (the dataclass gives the rest): compiled (mypyc), a written one is native,
    where the one ``dataclass`` makes is Python run by the interpreter, once a request (the same for ``Served``,
    ``limits.Admission``, ``body.Body``)."""

    send: Send
    rid: str
    path: str  # upstream: /chat/completions or /completions
    key: KeyRoute
    table: RouteTable  # the route table as the request found it
    endpoint: EndpointRoute
    body: dict[str, Any]  # as it came; passed upstream with ``model`` replaced
    stream: bool
    client_usage: bool  # a stream whose client asked for the usage chunk
    reserve: int  # tokens reserved at admission
    auth: bytes  # the caller's Authorization, for a peer gateway only
    hopped: bool  # came from a peer gateway: no peers again
    admission: Admission | None = None  # the rate limits' answer: its headers go on every answer (``limit_headers``)
    least: int = 0  # a lower bound on the context tokens it needs (``body.Body.least``)
    deadline: float = 0.0
    attempts: list[str] = field(default_factory=list)
    served: Served | None = None  # what answered, once the walk is over (the metrics' labels)
    ready: tuple[Backend, Headers] | None = None  # the attempt in flight's answer headers, made while it is awaited
    _limits: Headers | None = field(default=None, repr=False)

    def __init__(self, send: Send, rid: str, path: str, key: KeyRoute, table: RouteTable, endpoint: EndpointRoute,
                 body: dict[str, Any], stream: bool, client_usage: bool, reserve: int, auth: bytes, hopped: bool,
                 admission: Admission | None = None, least: int = 0, deadline: float = 0.0,
                 attempts: list[str] | None = None, served: Served | None = None,
                 ready: tuple[Backend, Headers] | None = None, _limits: Headers | None = None) -> None:
        self.send, self.rid, self.path, self.key, self.table, self.endpoint = send, rid, path, key, table, endpoint
        self.body, self.stream, self.client_usage, self.reserve, self.auth = body, stream, client_usage, reserve, auth
        self.hopped, self.admission, self.least, self.deadline = hopped, admission, least, deadline
        self.attempts = attempts if attempts is not None else []
        self.served, self.ready, self._limits = served, ready, _limits

    def limit_headers(self) -> Headers:
        """The rate-limit headers every answer carries (``Admission.headers``), made when first asked for: on the
        way of a request that is served, while the upstream works on it (``Walk._send``), not before it goes."""
        h = self._limits
        if h is None:
            h = self._limits = self.admission.headers() if self.admission is not None else []
        return h


@dataclass(slots=True, init=False)
class Served:
    backend: Backend
    served_by: str
    region: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 200
    broken: str | None = None  # failed after the head went out (a stream cut short): the backend's failure

    def __init__(self, backend: Backend, served_by: str, region: str, prompt_tokens: int = 0,
                 completion_tokens: int = 0, status: int = 200, broken: str | None = None) -> None:
        self.backend, self.served_by, self.region = backend, served_by, region
        self.prompt_tokens, self.completion_tokens, self.status, self.broken = \
            prompt_tokens, completion_tokens, status, broken


class Failed(Exception):
    """An attempt that did not work out; the chain moves on. ``retry_s``: the backend's 429 said when to
    come back; ``reply``: the answer to pass through should nothing be left to try (a context error)."""

    def __init__(self, kind: str, *, breaker: bool = True, retry_s: float | None = None,
                 reply: tuple[Headers, bytes, Served] | None = None) -> None:
        super().__init__(kind)
        self.kind, self.breaker, self.retry_s, self.reply = kind, breaker, retry_s, reply


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


async def answer(send: Send, status: int, body: bytes, rid: str, region: str, headers: Headers | None = None) -> None:
    """A whole JSON answer of the gateway's own."""
    h = [JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode()),
         (b"x-tensora-region", region.encode())]
    await send({"type": "http.response.start", "status": status, "headers": h + (headers or [])})
    await send({"type": "http.response.body", "body": body})
