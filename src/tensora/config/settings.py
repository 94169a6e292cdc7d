"""``tensora serve``'s settings and where they come from: defaults, a YAML config file, ``TENSORA_<SETTING>``
environment variables, then flags (rising precedence); a bad value names its file and line, variable or flag."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tensora import listeners
from tensora.config import yamlsource
from tensora.config.quotas import Limits, OwnerSettings, Quotas
from tensora.config.wording import in_words
from tensora.drivers.hardware import NodeOverrides
from tensora.errors import ConfigError
from tensora.names import DOMAIN_PATTERN, NAME_PATTERN
from tensora.telemetry.scrape import check_listen, metrics_beside_port
from tensora.telemetry.tracing import TracingSettings
from tensora.units import parse_memory

ADMIN_KEY_FILE = "admin-key"
UP_LOCK_FILE = "up.pid"


def default_data_dir() -> Path:
    """The user's data folder (platformdirs: ~/.local/share/tensora on Linux)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("tensora", appauthor=False))


class RuntimeSettings(BaseModel):
    """Model-server runtimes of the local driver (``tensora.models.runtimes``)."""

    model_config = ConfigDict(extra="forbid")

    auto_install: bool | None = Field(default=None, description="install the runtime the first endpoint needs "
                                      "in the background, the endpoint waiting meanwhile (default: on for "
                                      "tensora up, off for tensora serve)")


class ServeSettings(BaseModel):
    """Everything ``tensora serve`` can be told."""

    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir, description="the SQLite store, admin-key, owners' "
                           "files, and the local driver's replicas and logs")
    database_url: str | None = Field(default=None, description="postgresql://... for PostgreSQL (psycopg 3); "
                                     "default: SQLite at DATA_DIR/tensora.db")
    driver: Literal["simulated", "local", "kubernetes"] = Field(
        default="simulated", description="where replicas run: a simulated fleet (nodes), this machine (local, as "
        "tensora up), or a Kubernetes cluster")
    nodes: Path | None = Field(default=None, description="simulated driver: nodes.yaml of the fleet (default: a "
                               "small L40S + A100 + CPU fleet)")
    catalog: Path | None = Field(default=None, description="an operator catalog of classes overriding the default")
    host: str = Field(default="127.0.0.1", description="the control API's bind address")
    port: int = Field(default=8700, ge=0, le=65535, description="the control API's port")
    sandbox_port: int | None = Field(default=None, ge=1, le=65535, description="local driver: the port on "
                                     "127.0.0.1 where the sandboxes reach the API (their 127.0.0.1:<port> is "
                                     "forwarded here), so that their connections are counted apart from the "
                                     "host's clients'; default port + 20 (8720)")
    region: str = Field(default="local", pattern=NAME_PATTERN, description="the region this server and its "
                        "controller serve")
    max_in_flight: int = Field(default=256, ge=1, description="requests at once: more get 503 with Retry-After "
                               "(/healthz is exempt)")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="a JSON request body: 413 beyond, before it "
                                "is read (uploads to /v1/files stream under the owner's storage quota instead)")
    # what one client may hold of an API worker's HTTP server (tensora.api.server)
    max_header_bytes: int = Field(default=32 << 10, ge=1024, description="request line and headers: 431 beyond")
    max_headers: int = Field(default=100, ge=8, description="headers per request: 431 beyond")
    header_timeout_s: float = Field(default=10.0, gt=0, description="from a request's first byte to its last "
                                    "header: 408 beyond")
    idle_timeout_s: float = Field(default=30.0, gt=0, description="a connection with no request is closed after "
                                  "this; a body that stops coming this long is a 408")
    max_connections: int = Field(default=1024, ge=1, description="open connections per HTTP worker: 503 with "
                                 "Retry-After beyond")
    max_connections_per_client: int = Field(default=128, ge=1, description="open connections from one client "
                                            "address per HTTP worker (its share of max_connections): 503 with "
                                            "Retry-After to that client beyond; behind a proxy, raise it to "
                                            "max_connections")
    tick_s: float = Field(default=2.0, gt=0, description="the controller's cycle when nothing wakes it sooner")
    lease_ttl_s: float = Field(default=15.0, gt=0, description="the region's controller lease: a standby takes "
                               "over once the leader has not renewed it this long")
    drain_s: float = Field(default=5.0, ge=0, description="a replica replaced by a move back keeps serving the "
                           "requests in flight this long (gateways pick up the new route within poll_s)")
    retention_s: float = Field(default=7 * 86400.0, ge=600, description="how long the events of a deleted "
                               "workload and the driver's record of an ended replica (the local driver's replica "
                               "dir, its log) are kept; at least 10 min, so a controller that was down a while "
                               "still finds the record of a replica that ended meanwhile")
    start_delay_s: float = Field(default=2.0, ge=0, description="simulated driver: seconds until a replica runs")
    node: NodeOverrides = Field(default_factory=NodeOverrides, description="local driver: what to declare "
                                "instead of (or keep back from) the detected hardware")
    kubeconfig: Path | None = Field(default=None, description="kubernetes driver: the cluster's kubeconfig "
                                    "(default: in-cluster credentials, else ~/.kube/config)")
    namespace: str = Field(default="tensora", pattern=NAME_PATTERN,
                           description="kubernetes driver: the namespace of the replicas' objects")
    notebook_domain: str | None = Field(default=None, pattern=DOMAIN_PATTERN,
                                        description="kubernetes driver: each notebook gets an Ingress at "
                                        "https://<name>.<notebook_domain>/ (a wildcard DNS record and certificate "
                                        "at the ingress controller); default: none, the Service's cluster address. "
                                        "In a registrable domain of its own (as github.io is to github.com), never "
                                        "the dashboard's host nor a name above or below it: tenant pages must be "
                                        "cross-site to the dashboard")
    ingress_class: str | None = Field(default=None, description="kubernetes driver: the notebooks' IngressClass "
                                      "(default: the cluster's default class)")
    storage_class: str | None = Field(default=None, pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
                                      description="kubernetes driver: the StorageClass of notebooks' home claims, "
                                      "one whose volumes attach on any node (default: the cluster's default)")
    home_size: str = Field(default="10Gi", pattern=r"^[1-9][0-9]*(Mi|Gi|Ti)$",
                           description="the size of each notebook's home: its claim on Kubernetes, its own "
                           "loop-mounted file system on the local driver (ENOSPC inside past it)")
    log_size: str = Field(default="16Mi", pattern=r"^[1-9][0-9]*(Ki|Mi|Gi)$",
                          description="local driver: each replica's log and each VM's serial console are cut back "
                          "past this, one rotated file of as much kept beside it")
    files_claim: str | None = Field(default=None, pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
                                    description="kubernetes driver: the claim, in the replicas' namespace, of the "
                                    "share the API's pods mount at DATA_DIR/files (owners' files); endpoints "
                                    "serve their models from it as pvc://<files_claim>/<owner dir>/<name>. "
                                    "Default: none, and endpoints cannot start")
    controller: bool = Field(default=True, description="run the region's controller in this process (false, "
                             "--no-controller: the API only, another process leads)")
    workers: int = Field(default=1, ge=1, le=64, description="HTTP worker processes; the controller runs in "
                         "the supervising process, woken over a unix socket")
    log_level: str = Field(default="warning", description="the server's log level (debug, info, warning, error)")
    gateway: dict[str, Any] = Field(default_factory=dict, description="the gateway's settings (tensora gateway "
                                    "and tensora up read them here), e.g. {port: 8701, redis_url: ...}")
    metrics_listen: str | None = Field(default="127.0.0.1:8710", description="host:port of the control API's and "
                                       "controller's /metrics (Prometheus' text format), apart from the API's port; "
                                       "default 127.0.0.1:<port + 10> (none where port is 0); null: no metrics. "
                                       "The gateway has its own (gateway.metrics_listen)")
    tracing: TracingSettings | None = Field(default=None, description="OpenTelemetry: {otlp_endpoint: URL} traces "
                                            "each controller cycle (the tracing extra); null: off. The gateway "
                                            "has its own (gateway.tracing)")
    gateway_port: int | None = Field(default=None, ge=0, le=65535, description="tensora up: the gateway's port "
                                     "(default 8701); the gateway runs beside the API in its own process")
    storage_quota: str | None = Field(default=None, pattern=r"^[1-9][0-9]*(Mi|Gi|Ti)$",
                                      description="the older name of quotas.storage_bytes (e.g. 20Gi): when set, "
                                      "the default of every owner's files quota; set one of the two")
    quotas: Quotas = Field(default_factory=Quotas, description="what each owner may hold unless an admin set "
                           "otherwise for it (PUT /v1/owners/{owner}): keys, workloads, running_gpus, running_cpu, "
                           "storage_bytes")
    limits: Limits = Field(default_factory=Limits, description="how fast each owner may call "
                           "unless an admin set otherwise: requests_per_minute, tokens_per_minute (the gateway's); "
                           "creates_per_minute, deletes_per_minute, uploads_per_minute (the control API's)")
    shared_models: dict[str, Path] = Field(default_factory=dict, description="read-only roots every owner may name "
                                           "as shared/<name>/<path> in model and image, e.g. {pool: /srv/models}")
    sandbox_uids: str = Field(default="100000-165535", pattern=r"^[1-9][0-9]*-[1-9][0-9]*$",
                              description="the uids (each also the gid) owners' sandboxes run as: one per owner, "
                              "allocated on first use; never 0 or Tensora's own")
    runtimes: RuntimeSettings = Field(default_factory=RuntimeSettings, description="local driver: the "
                                      "model-server runtimes")
    session_lifetime_s: float = Field(default=12 * 3600.0, ge=60, le=30 * 86400.0, description="the dashboard: a "
                                      "signed-in browser's session ends this long after sign-in, however active")
    session_idle_s: float = Field(default=3600.0, ge=60, description="the dashboard: a session also ends this long "
                                  "after the last page its user opened (a page's own refresh does not count)")
    isolation: Literal["sandbox", "none"] = Field(
        default="sandbox", description="local driver: 'sandbox' runs every replica in a sandbox of its own (runc: "
        "the owner's uid, read-only host, the class's limits, its own network); where this host cannot sandbox, "
        "only the admin owner's workloads run. 'none' runs every owner's replicas unsandboxed, as Tensora's user")

    def owner_defaults(self) -> OwnerSettings:
        quotas = self.quotas
        if self.storage_quota is not None:
            quotas = quotas.model_copy(update={"storage_bytes": parse_memory(self.storage_quota)})
        return OwnerSettings(quotas=quotas, limits=self.limits)

    def sandbox_listener(self) -> int | None:
        """The port of the API's sandbox listener (``tensora.listeners``): only the local driver's sandboxes
        reach the API through pasta; None otherwise, or when the API's port is ephemeral."""
        if self.driver != "local":
            return None
        return self.sandbox_port if self.sandbox_port is not None else listeners.derived(self.port)

    @model_validator(mode="before")
    @classmethod
    def _metrics_beside_port(cls, data: Any) -> Any:
        return metrics_beside_port(data, cls.model_fields["port"].default)

    @model_validator(mode="after")
    def _sandbox_port_apart(self) -> ServeSettings:
        if self.sandbox_port is not None and self.sandbox_port == self.port:
            raise ValueError("sandbox_port: must differ from port (the sandboxes' connections are counted apart)")
        return self

    @model_validator(mode="after")
    def _one_storage_quota(self) -> ServeSettings:
        if self.storage_quota is not None and "storage_bytes" in self.quotas.model_fields_set:
            raise ValueError("storage_quota is the older name of quotas.storage_bytes: set one of the two")
        return self

    @field_validator("metrics_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return check_listen(v)

    @field_validator("notebook_domain")
    @classmethod
    def _apart_from_tensoras_host(cls, v: str | None, info: ValidationInfo) -> str | None:
        """Notebooks are tenants' pages: a domain that is the API's host (``host``, where it is a name), or
        above or below it, would make them same-site to the dashboard, or give them its cookies outright."""
        host = str(info.data.get("host") or "").lower().rstrip(".")
        if v is None or not host or _is_ip(host):
            return v
        if host == v or host.endswith("." + v) or v.endswith("." + host):
            raise ValueError(f"{v!r} is, or is above or below, the API's host {host!r}: notebooks would share a "
                             "site with the dashboard; use a registrable domain of their own (as github.io is "
                             "to github.com)")
        return v

    @field_validator("shared_models")
    @classmethod
    def _shared_names(cls, roots: dict[str, Path]) -> dict[str, Path]:
        for name, path in roots.items():
            if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,62}", name) or not path.is_absolute():
                raise ValueError(f"shared_models.{name}: a name of a-z, 0-9, '.', '_', '-' and an absolute path")
        return roots

    @property
    def db_url(self) -> str:
        return self.database_url or str(self.data_dir / "tensora.db")

    @property
    def uid_range(self) -> tuple[int, int]:
        first, _, last = self.sandbox_uids.partition("-")
        return int(first), int(last)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def isolation_of(settings: ServeSettings, why_not: Callable[[], str | None] | None = None) -> tuple[str, str | None]:
    """How the local driver isolates replicas here, and why when not sandboxed: ``("sandbox", None)``,
    ``("none", None)`` (the operator's choice) or ``("admin-only", reason)`` (this host cannot sandbox and
    the operator chose nothing: only the admin owner's workloads run). ``("", None)``: not the local driver."""
    if settings.driver != "local":
        return "", None
    if settings.isolation == "none":
        return "none", None
    from tensora.sandbox import available

    reason = (why_not or available)()
    return ("sandbox", None) if reason is None else ("admin-only", reason)


def describe_isolation(mode: str, reason: str | None) -> str:
    """The isolation in one line, as ``tensora up`` and ``tensora node`` say it."""
    if mode == "sandbox":
        return ("isolation: sandbox (each replica in a runc sandbox: the owner's uid, read-only host, its class's "
                "limits, its own network)")
    if mode == "none":
        return "isolation: none (set by the operator): every owner's replicas run unsandboxed, as Tensora's user"
    return (f"isolation: unavailable ({reason}): serving the admin owner only; other owners' workloads are "
            "refused (set isolation: none to run them unsandboxed)")


def load_settings(config: Path | None, flags: dict[str, Any], env: dict[str, str] | None = None) -> ServeSettings:
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}  # setting -> where its value came from, so an error names that place
    lines: yamlsource.Lines | None = None
    if config is not None:
        data, lines = yamlsource.load(Path(config), ConfigError)
        if not isinstance(data, dict):
            raise ConfigError("the config file must be a mapping of settings", source=str(config))
        values.update(data)
        origin.update(dict.fromkeys(data, str(config)))
    settings: ServeSettings = layered(ServeSettings, values, origin, env, "TENSORA_", flags, lines=lines,
                                      config=config)
    return settings


def layered(model: type[BaseModel], values: dict[str, Any], origin: dict[str, str], env: dict[str, str],
            prefix: str, flags: dict[str, Any], *, lines: yamlsource.Lines | None = None,
            config: Path | None = None, field_prefix: str = "") -> Any:
    """``values`` (defaults, a config file), then ``<prefix><SETTING>`` from env, then flags, validated
    into ``model``; a bad value is a ConfigError naming where it came from (file and line, variable
    or flag) and the field. ``origin``: setting -> its source so far."""
    for name in model.model_fields:
        if f"{prefix}{name.upper()}" in env:
            values[name] = env[f"{prefix}{name.upper()}"]
            origin[name] = f"{prefix}{name.upper()}"
    for name, value in flags.items():
        if value is not None:
            values[name], origin[name] = value, "--" + name.replace("_", "-")
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        name = str(first["loc"][0]) if first["loc"] else ""
        source = origin.get(name, "<settings>")
        line = lines.line((name,)) if lines is not None and source == str(config) else None
        raise ConfigError("unknown setting" if first["type"] == "extra_forbidden" else in_words(first),
                          source=source, line=line, field=f"{field_prefix}{field}" if field else None) from None
