"""``tensora gateway``: settings, the route table from the control API, and the server.

The route table is polled from the control API (``GET /v1/gateway/routes`` with If-None-Match,
every ``poll_s``), kept in memory and in ``DATA_DIR/gateway/routes.json``; while the control API
is down the gateway serves from the last table it has (ADR-0008), from disk after a restart.
Usage goes back in batches (``metering``); rate limits are in memory, or in Redis with
``redis_url`` so that several gateways share them (``redis_fail_mode`` says what happens while it is down);
Idempotency-Key records likewise, else on disk in ``DATA_DIR/gateway/idempotency``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tensora import listeners
from tensora.gateway.breaker import Policy
from tensora.gateway.chain import Peer
from tensora.gateway.idempotency import DiskStore, Idempotency, RedisStore
from tensora.gateway.limits import FailMode, Limiter, MemoryLimiter, RedisLimiter
from tensora.gateway.metering import Meter
from tensora.gateway.metrics import GatewayCollector, GatewayMetrics
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routedoc import RouteDocument
from tensora.gateway.routes import RouteTable, table_from_json
from tensora.gateway.server import Limits
from tensora.gateway.upstream import Client, peer_url_problem
from tensora.telemetry.scrape import Listener, check_free, check_listen, metrics_beside_port
from tensora.telemetry.tracing import TracingSettings, setup

log = logging.getLogger("tensora.gateway")

GATEWAY_SETTINGS_ENV = "TENSORA_GATEWAY_SETTINGS"  # tensora up hands its gateway child the settings in it (JSON)
USAGE_TIMEOUT_S = 10.0  # a usage batch's answer: past it the batch is kept for the next flush


class PeerSetting(BaseModel):
    model_config = ConfigDict(extra="forbid")
    region: str = Field(description="the peer's region")
    url: str = Field(description="the peer gateway's base URL, ending in /v1")


class GatewaySettings(BaseModel):
    """Everything ``tensora gateway`` can be told (config file ``gateway:`` keys, TENSORA_GATEWAY_*, flags)."""

    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(description="the server's data dir: admin-key, and gateway/ for the route cache and "
                           "the usage spool")
    control_url: str = Field(default="http://127.0.0.1:8700", description="the control API: routes are read from "
                             "it and usage is sent to it")
    key_file: Path | None = Field(default=None, description="an admin key to read routes and send usage with; "
                                  "default DATA_DIR/admin-key")
    host: str = Field(default="127.0.0.1", description="the gateway's bind address")
    port: int = Field(default=8701, ge=0, le=65535, description="the gateway's port")
    sandbox_port: int | None = Field(default=None, ge=1, le=65535, description="the port on 127.0.0.1 where the "
                                     "local driver's sandboxes reach the gateway (their 127.0.0.1:<port> is "
                                     "forwarded here), their connections counted apart from the host's clients'; "
                                     "with the local driver the default is port + 20 (8721), else none")
    metrics_listen: str | None = Field(default="127.0.0.1:8711", description="host:port of this gateway's "
                                       "/metrics (Prometheus' text format), apart from its port; default "
                                       "127.0.0.1:<port + 10> (none where port is 0); null: no metrics")
    metrics_max_labels: int = Field(default=100, ge=1, description="values of the endpoint and owner labels "
                                    "kept (the first seen); the rest are counted as 'other'")
    region: str = Field(default="local", description="the region this gateway serves")
    poll_s: float = Field(default=1.0, gt=0, description="how often the routes are read from the control API")
    startup_grace_s: float = Field(default=15.0, ge=0, description="no warning that the control API is "
                                   "unreachable until this long after start (it may be starting beside the "
                                   "gateway, as under tensora up); once it has answered, an outage warns at once")
    ttft_s: float = Field(default=30.0, gt=0, description="per attempt: time to the first token")
    deadline_s: float = Field(default=120.0, gt=0, description="per request, all attempts together")
    stream_idle_s: float = Field(default=30.0, gt=0, le=600, description="after a stream's first token, the longest "
                                 "it may go without an event before it is ended (per endpoint: spec.stream_idle_s)")
    retry_delay_s: float = Field(default=0.1, ge=0, le=10, description="before the one retry of a tier's only "
                                 "backend (jittered 0.5x-1.5x)")
    connect_timeout_s: float = Field(default=2.0, gt=0, description="per attempt: connecting to a backend")
    retry_after_s: int = Field(default=5, ge=1, description="Retry-After of the gateway's own 503s when no sooner "
                               "time is known")
    requests_per_minute: int = Field(default=600, ge=1, description="an owner's limit when the control API's "
                                     "route table gives none (an older control API)")
    tokens_per_minute: int = Field(default=1_000_000, ge=1, description="an owner's limit when the control API's "
                                   "route table gives none (an older control API)")
    default_max_tokens: int = Field(default=256, ge=1, description="tokens reserved for a request that names no "
                                    "max_tokens")
    redis_url: str | None = Field(default=None, description="redis://... to share rate limits and kept answers "
                                  "between gateways; default: this gateway's own")
    redis_timeout_s: float = Field(default=0.05, gt=0, description="each Redis call, once connected")
    redis_connect_timeout_s: float = Field(default=0.05, gt=0, description="connecting to Redis")
    redis_fail_mode: FailMode = Field(default=FailMode.LOCAL, description="Redis unreachable or timing out: "
                                      "'local' admits against this gateway's own windows at limit / replicas; "
                                      "'closed' answers 503 with Retry-After")
    redis_probe_s: float = Field(default=1.0, gt=0, description="while Redis is down, how often to try it again")
    replicas: int = Field(default=1, ge=1, description="how many gateways share this Redis (this one "
                          "included): while it is down, each admits this share of every limit")
    breaker_consecutive: int = Field(default=5, ge=1, description="consecutive failures that open a backend's "
                                     "breaker")
    breaker_base_s: float = Field(default=30.0, gt=0, description="an open breaker ejects its backend this long "
                                  "times the number of its ejections")
    breaker_max_s: float = Field(default=300.0, gt=0, description="the longest ejection")
    probe_interval_s: float = Field(default=2.0, gt=0, description="how often a backend whose breaker is open "
                                    "is probed (GET /v1/models), less up to a quarter at random")
    probe_successes: int = Field(default=2, ge=1, description="good probes in a row that close its breaker")
    rate_limit_backoff_s: float = Field(default=1.0, gt=0, description="a backend's 429 without Retry-After: "
                                        "how long it is skipped (times 0.5 to 1.5 at random)")
    usage_flush_s: float = Field(default=1.0, gt=0, description="how often usage is sent to the control API (a "
                                 "failed send backs off, doubling up to a minute)")
    usage_spool_max_bytes: int = Field(default=256 << 20, ge=1 << 16, description="usage on disk waiting for the "
                                       "control API: records past it are dropped (and counted)")
    idempotency_keep_s: float = Field(default=24 * 3600.0, gt=0, description="how long an answer is replayed "
                                      "to the same Idempotency-Key and body")
    idempotency_max_answer_bytes: int = Field(default=1 << 20, ge=0, description="an answer over this is served "
                                              "but not kept: its retry runs again")
    idempotency_max_total_bytes: int = Field(default=256 << 20, ge=0, description="all kept answers together "
                                             "(on disk, or in Redis with redis_url); past it, new ones are not kept")
    idempotency_max_owner_bytes: int = Field(default=64 << 20, ge=0, description="the kept answers of one owner "
                                             "(all its keys): past it, that owner's new ones are not kept, so that "
                                             "one owner cannot fill the store for all")
    peers: list[PeerSetting] = Field(default_factory=list, description="other regions' gateways; the caller's "
                                     "key travels to them, so https (certificate checked) unless on loopback")
    # what one client may hold of the gateway's HTTP server (Envoy's defaults where it has one)
    max_header_bytes: int = Field(default=60 << 10, ge=1024, description="request line and headers: 431 beyond")
    max_headers: int = Field(default=100, ge=8, description="headers per request: 431 beyond")
    header_timeout_s: float = Field(default=10.0, gt=0, description="from a request's first byte to its last "
                                    "header: 408 beyond")
    idle_timeout_s: float = Field(default=60.0, gt=0, description="a keep-alive connection with no request is "
                                  "closed after this; a body that stops coming this long is a 408")
    max_body_bytes: int = Field(default=8 << 20, ge=1024, description="a request body: 413 beyond")
    max_connections: int = Field(default=10_000, ge=1, description="open client connections: 503 with "
                                 "Retry-After beyond")
    max_connections_per_client: int = Field(default=1_000, ge=1, description="open connections from one client "
                                            "address (its share of max_connections): 503 with Retry-After to that "
                                            "client beyond; behind a proxy, raise it to max_connections")
    max_pipelined: int = Field(default=8, ge=1, description="requests queued behind the one in flight on a "
                               "connection: reading stops there")
    busy_poll_us: int = Field(default=0, ge=0, le=10_000, description="busy polling: after each request in and "
                              "answer out, poll this long rather than sleep (latency for CPU; 0: off; see the "
                              "operating guide, busy polling)")
    write_buffer_bytes: int = Field(default=64 << 10, ge=1024, description="answer bytes a client that does not "
                                    "read may leave waiting: reading it and its stream stop there")
    max_upstream_body_bytes: int = Field(default=32 << 20, ge=1024, description="a model server's whole answer: "
                                         "502 beyond")
    max_sse_event_bytes: int = Field(default=1 << 20, ge=1024, description="one event of a model server's stream: "
                                    "the stream ends with an error event beyond")
    log_level: str = Field(default="warning", description="the gateway's log level (debug, info, warning, error)")
    tracing: TracingSettings | None = Field(default=None, description="OpenTelemetry: {otlp_endpoint: URL} "
                                            "traces each request and its attempts (the tracing extra); null: off")

    @field_validator("metrics_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return check_listen(v)

    @model_validator(mode="before")
    @classmethod
    def _metrics_beside_port(cls, data: Any) -> Any:
        return metrics_beside_port(data, cls.model_fields["port"].default)

    @model_validator(mode="after")
    def _sandbox_port_apart(self) -> GatewaySettings:
        if self.sandbox_port is not None and self.sandbox_port == self.port:
            raise ValueError("sandbox_port: must differ from port (the sandboxes' connections are counted apart)")
        return self

    @field_validator("peers")
    @classmethod
    def _peers_safe(cls, peers: list[PeerSetting]) -> list[PeerSetting]:
        for i, p in enumerate(peers):
            problem = peer_url_problem(p.url)
            if problem:
                raise ValueError(f"peers[{i}].url ({p.region}): {problem}")
        return peers

    def options(self) -> Options:
        return Options(region=self.region, ttft_s=self.ttft_s, deadline_s=self.deadline_s,
                       connect_timeout_s=self.connect_timeout_s, retry_after_s=self.retry_after_s,
                       rpm=self.requests_per_minute, tpm=self.tokens_per_minute,
                       default_max_tokens=self.default_max_tokens, stream_idle_s=self.stream_idle_s,
                       retry_delay_s=self.retry_delay_s,
                       breaker=Policy(self.breaker_consecutive, self.breaker_base_s, self.breaker_max_s,
                                      self.probe_successes), rate_limit_backoff_s=self.rate_limit_backoff_s,
                       peers=tuple(Peer(p.region, p.url.rstrip("/")) for p in self.peers),
                       max_body_bytes=self.max_body_bytes, max_upstream_body_bytes=self.max_upstream_body_bytes,
                       max_sse_event_bytes=self.max_sse_event_bytes)

    def limits(self) -> Limits:
        return Limits(max_header_bytes=self.max_header_bytes, max_headers=self.max_headers,
                      header_timeout_s=self.header_timeout_s, idle_timeout_s=self.idle_timeout_s,
                      max_body_bytes=self.max_body_bytes, max_connections=self.max_connections,
                      max_connections_per_client=self.max_connections_per_client,
                      max_pipelined=self.max_pipelined, write_buffer_bytes=self.write_buffer_bytes,
                      retry_after_s=self.retry_after_s)

    @property
    def dir(self) -> Path:
        return self.data_dir / "gateway"


class RouteSource:
    """The latest route table: polled from the control API, cached on disk.

    An unreachable control API is warned about once per outage; not while it may still be
    starting (``grace_s`` from the first poll, until it first answers)."""

    def __init__(self, control_url: str, key: str, cache: Path, poll_s: float, grace_s: float = 0.0) -> None:
        self.url = control_url.rstrip("/") + "/v1/gateway/routes"
        self.key, self.cache, self.poll_s, self.grace_s = key, cache, poll_s, grace_s
        self.table = RouteTable()
        self.etag: str | None = None
        self.fresh_at: float | None = None
        self.changed = asyncio.Event()
        if cache.exists():
            try:
                self._set(orjson.loads(cache.read_bytes()), save=False)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("route cache %s unreadable (%s); waiting for the control API", cache, exc)

    def _set(self, data: RouteDocument, save: bool = True) -> None:
        self.table = table_from_json(data)
        self.etag = f'"{self.table.version}"'
        if save:
            tmp = self.cache.with_suffix(".tmp")
            tmp.write_bytes(orjson.dumps(data))
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.cache)
        self.changed.set()

    async def poll_once(self, client: httpx.AsyncClient) -> bool:
        headers = {"authorization": f"Bearer {self.key}"}
        if self.etag:
            headers["if-none-match"] = self.etag
        r = await client.get(self.url, headers=headers)
        if r.status_code == 304:
            return False
        r.raise_for_status()
        self._set(r.json())
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + self.grace_s  # 0 once the control API has answered
        async with httpx.AsyncClient(timeout=5.0) as client:
            warned = False
            while True:
                try:
                    await self.poll_once(client)
                    if warned:
                        log.warning("control API back: routes %s", self.table.version)
                    warned, quiet_until = False, 0.0
                except (ValueError, KeyError, TypeError) as exc:  # it answered, with a table this gateway refuses
                    if not warned:
                        log.error("control API's route table refused (%s: %s): serving routes %s from memory",
                                  type(exc).__name__, exc, self.table.version or "(none yet)")
                        warned = True
                except Exception as exc:
                    if not warned and loop.time() >= quiet_until:
                        log.warning("control API unreachable (%s): serving routes %s from memory",
                                    type(exc).__name__, self.table.version or "(none yet)")
                        warned = True
                await asyncio.sleep(self.poll_s)


def read_key(settings: GatewaySettings) -> str:
    env = os.environ.get("TENSORA_GATEWAY_KEY")
    if env:
        return env.strip()
    path = settings.key_file or settings.data_dir / "admin-key"
    try:
        return path.read_text().strip()
    except OSError as exc:
        from tensora.errors import ConfigError

        raise ConfigError(f"cannot read the gateway's key: {exc.strerror}", source=str(path),
                          field="key_file") from None


def build(settings: GatewaySettings) -> Gateway:
    key = read_key(settings)
    settings.dir.mkdir(parents=True, exist_ok=True)
    source = RouteSource(settings.control_url, key, settings.dir / "routes.json", settings.poll_s,
                         settings.startup_grace_s)
    usage = Client(settings.connect_timeout_s)  # the gateway's own: httpx's Python per post showed in the p99
    auth = [("authorization", f"Bearer {key}")]

    async def send_usage(records: list[bytes]) -> bool:
        body = b'{"records":[' + b",".join(records) + b"]}"
        async with asyncio.timeout(USAGE_TIMEOUT_S):  # the head, and the body after it
            resp = await usage.post(settings.control_url, "/v1/gateway/usage", body, auth, USAGE_TIMEOUT_S)
            try:
                answer = await resp.read()
            finally:
                resp.release()
        if resp.status >= 400:
            log.warning("usage batch refused: %s %s", resp.status, answer[:200].decode("utf-8", "replace"))
        return resp.status < 500 and resp.status != 429

    meter = Meter(settings.dir / "spool", send_usage, flush_s=settings.usage_flush_s,
                  max_bytes=settings.usage_spool_max_bytes)
    limiter: Limiter = MemoryLimiter()
    if settings.redis_url:
        limiter = RedisLimiter(settings.redis_url, timeout_s=settings.redis_timeout_s,
                               connect_timeout_s=settings.redis_connect_timeout_s,
                               fail_mode=settings.redis_fail_mode, replicas=settings.replicas,
                               probe_s=settings.redis_probe_s)
    idem = Idempotency(
        DiskStore(settings.dir / "idempotency", settings.idempotency_max_total_bytes,
                  settings.idempotency_max_owner_bytes),
        RedisStore(limiter.redis, max_total_bytes=settings.idempotency_max_total_bytes,
                   max_owner_bytes=settings.idempotency_max_owner_bytes)
        if isinstance(limiter, RedisLimiter) else None,
        keep_s=settings.idempotency_keep_s, in_flight_s=settings.deadline_s + 10,
        max_answer_bytes=settings.idempotency_max_answer_bytes, probe_s=settings.redis_probe_s)
    metrics = GatewayMetrics(settings.metrics_max_labels) if settings.metrics_listen else None
    tracing = setup(settings.tracing, "tensora-gateway")
    tasks: list[asyncio.Task[None]] = []
    stopping: list[bool] = []
    # the metrics listener reads the gateway (``GatewayCollector``): made once the gateway is, below, and before
    # these hooks run (the gateway's lifespan, once it is served)
    listener: Listener | None = None

    def supervised(name: str, run: Callable[[], Coroutine[Any, Any, None]], restart_s: float) -> None:
        """The usage sender and the prober log and go on after errors of their own; should one end anyway,
        it is said loudly and started again (else usage would pile up in the spool, unsent, or an ejected
        backend would wait out its whole cooldown, unnoticed)."""
        if stopping:
            return
        task = asyncio.create_task(run())
        tasks.append(task)

        def ended(t: asyncio.Task[None]) -> None:
            if t.cancelled() or stopping:
                return
            exc = t.exception()
            log.critical("the %s stopped (%r); starting it again", name, exc or "returned", exc_info=exc)
            asyncio.get_running_loop().call_later(restart_s, supervised, name, run, restart_s)

        task.add_done_callback(ended)

    async def startup() -> None:
        if listener is not None:
            listener.start()
        tasks.append(asyncio.create_task(source.run()))
        supervised("usage sender", meter.run, settings.usage_flush_s)
        assert gw.prober is not None  # made with probe_interval_s
        supervised("prober", gw.prober.run, settings.probe_interval_s)

    async def shutdown() -> None:
        stopping.append(True)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        with contextlib.suppress(Exception):
            await asyncio.wait_for(meter.flush(), 5)
        meter.close()
        usage.close()
        if listener is not None:
            listener.close()
        if tracing is not None:
            tracing.close()

    # the table's getter runs on every request: C parts alone (a lambda here ran as interpreted Python)
    gw = Gateway(settings.options(), functools.partial(getattr, source, "table"), limiter, meter, idem=idem,
                 metrics=metrics, tracing=tracing, probe_interval_s=settings.probe_interval_s,
                 on_startup=[startup], on_shutdown=[shutdown])
    if metrics is not None and settings.metrics_listen:
        listener = Listener(settings.metrics_listen, GatewayCollector(gw, metrics, gw.clock))
    return gw


def run(settings: GatewaySettings, quiet: bool = False) -> None:
    from tensora.gateway import server

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sandboxes = listeners.listen(settings.sandbox_port, "gateway.sandbox_port") \
        if settings.sandbox_port is not None else None  # before anything starts: a clear error if taken
    check_free(settings.metrics_listen, "gateway.metrics_listen")  # its own metrics, or it does not start
    gw = build(settings)
    if not quiet:
        print(f"tensora gateway on http://{settings.host}:{settings.port}/v1  (region {settings.region}, "
              f"routes from {settings.control_url})", flush=True)
        if settings.metrics_listen:
            print(f"gateway metrics on http://{settings.metrics_listen}/metrics", flush=True)
    server.run(gw, settings.host, settings.port, limits=settings.limits(), busy_poll_s=settings.busy_poll_us / 1e6,
               sandbox_sock=sandboxes, reads=gw.reads)
