"""``tensora serve``: the control API and the controller of one region, in one process.

Settings come from, in rising precedence: defaults, a YAML config file (``--config``),
environment variables ``TENSORA_<SETTING>`` (e.g. ``TENSORA_DATABASE_URL``), and flags.
The database defaults to ``DATA_DIR/tensora.db`` (SQLite, WAL); a ``postgresql://`` URL
selects PostgreSQL. On first start an admin key is created and written to
``DATA_DIR/admin-key`` (mode 0600); the secret is never printed or logged.

``tensora up`` (``profile="up"``) is one per data dir: it holds an flock on ``DATA_DIR/up.pid``
(which says its pid and addresses) while it runs, so a crashed one never blocks the next. A
second one, or one whose port is taken, stops before it prints or writes anything.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tensora import listeners, replicakeys
from tensora.api.auth import KeyChecker, create_key
from tensora.api.idempotency import Idempotency
from tensora.api.services import Services
from tensora.api.sessions import Sessions
from tensora.apikeys import digest, well_formed
from tensora.clock import Clock, SystemClock
from tensora.config.catalog import load_catalog
from tensora.config.settings import (
    ADMIN_KEY_FILE,
    UP_LOCK_FILE,
    ServeSettings,
    describe_isolation,
    isolation_of,
    layered,
    load_settings,
)
from tensora.control.controller import Controller
from tensora.drivers.base import Driver, ReplicaStatus
from tensora.drivers.hardware import gpu_notes, offered
from tensora.errors import ConfigError, TensoraError
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaState
from tensora.placement.quotas import for_node, overlay, running_phrase
from tensora.storage import Storage
from tensora.store import keys as keys_repo
from tensora.store import owners as owners_repo
from tensora.store.db import Database, private_dir
from tensora.tracing import setup as setup_tracing
from tensora.units import parse_memory

if TYPE_CHECKING:
    from tensora.api.server import HttpLimits


class Occupied(TensoraError):
    """``tensora up`` cannot start: a Tensora already runs on this data dir or port, or another
    program holds the port. The message says which, and what to do."""


def load_gateway_settings(config: Path | None, flags: dict[str, Any],
                          env: dict[str, str] | None = None) -> Any:
    """``tensora gateway``: the config file's ``gateway:`` section, TENSORA_GATEWAY_* env, flags;
    ``data_dir``, region and the control API's address are the server's unless set there."""
    server = load_settings(config, {"data_dir": flags.get("data_dir")}, env)
    return gateway_settings_for(server, flags, env)


def _client_host(bind: str) -> str:
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


def make_driver(settings: ServeSettings, clock: Clock) -> Driver:
    if settings.driver == "simulated":
        from tensora.control.fleet import load_nodes
        from tensora.drivers.simulated import SimulatedDriver

        nodes_file = settings.nodes or Path(__file__).with_name("default_nodes.yaml")
        return SimulatedDriver(load_nodes(nodes_file), clock, start_delay_s=settings.start_delay_s)
    if settings.driver == "local":
        return local_driver(settings, load_catalog(settings.catalog))
    return kubernetes_driver(settings, load_catalog(settings.catalog))


def kubernetes_driver(settings: ServeSettings, catalog: Catalog) -> Driver:
    """The Kubernetes driver for the configured cluster; ConfigError naming what is missing."""
    try:
        from lightkube import ConfigError as KubeConfigError

        from tensora.drivers.kubernetes.driver import connect
    except ImportError:
        raise ConfigError("the kubernetes driver needs lightkube: pip install 'tensora[kubernetes]'",
                          field="driver") from None
    if settings.kubeconfig is not None and not settings.kubeconfig.is_file():
        raise ConfigError(f"no kubeconfig at {settings.kubeconfig}", field="kubeconfig")
    try:
        return connect(str(settings.kubeconfig) if settings.kubeconfig else None, catalog, settings.region,
                       settings.namespace, notebook_domain=settings.notebook_domain,
                       ingress_class=settings.ingress_class, storage_class=settings.storage_class,
                       home_size=settings.home_size, files_root=settings.data_dir / "files",
                       files_claim=settings.files_claim)
    except (KubeConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"cannot configure the Kubernetes client: {exc}", field="kubeconfig") from None


def local_driver(settings: ServeSettings, catalog: Catalog) -> Driver:
    from tensora.drivers.hardware import detect, local_node
    from tensora.drivers.local import LocalDriver

    hw = detect(catalog)
    node = local_node(hw, settings.node, settings.region)
    mode, _ = isolation_of(settings)
    return LocalDriver(settings.data_dir, node, catalog, [g.index for g in hw.gpus if g.model],
                       vfio=settings.node.vfio, isolation=mode, allow_host_ports=sandbox_forwards(settings),
                       files_root=settings.data_dir / "files", shared_models=settings.shared_models,
                       nvidia_driver=settings.node.nvidia_driver,
                       auto_install=bool(settings.runtimes.auto_install),
                       home_size=parse_memory(settings.home_size), log_size=parse_memory(settings.log_size))


def sandbox_forwards(settings: ServeSettings) -> list[tuple[int, int]]:
    """What a sandbox reaches on the host's loopback: Tensora's API and gateway (they check keys), nothing else.
    Each pair is (the port at 127.0.0.1 inside, the host port it reaches): the servers' sandbox listeners, so that
    the sandboxes' connections are counted apart from the host's clients' (``tensora.listeners``)."""
    gw = gateway_settings_for(settings, {"port": settings.gateway_port})
    pairs = [(settings.port, settings.sandbox_listener() or settings.port), (gw.port, gw.sandbox_port or gw.port)]
    return [(inner, outer) for inner, outer in pairs if inner]


def installed_runtimes(driver: Driver, auto_install: bool) -> str:
    """``tensora up``'s line on the model-server runtimes: which are installed, and what happens without one."""
    from tensora.models import runtimes

    root = getattr(driver, "runtimes", None)
    if root is None:
        return "runtimes: not this driver's"
    have = [name for name in runtimes.REGISTRY if runtimes.installed(root, name)]
    then = ("the first endpoint that needs one installs it" if auto_install
            else "an endpoint without one fails: tensora runtime install tensora-transformers")
    return f"runtimes installed: {', '.join(have) or 'none'} (in {root}); {then}"


def ensure_admin_key(db: Database, data_dir: Path, now: float) -> Path:
    """Create the admin key on first start (or when its file no longer matches a live key)."""
    path = data_dir / ADMIN_KEY_FILE
    if path.exists():
        secret = path.read_text().strip()
        if well_formed(secret):
            with db.read() as conn:
                row = keys_repo.key_by_digest(conn, digest(secret))
            if row is not None and row.revoked_at is None:
                return path
    data_dir.mkdir(parents=True, exist_ok=True)
    with db.write() as conn:
        secret, _ = create_key(conn, "admin", "admin (created on first start)", ["admin"], now)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def build(settings: ServeSettings, *, clock: Clock | None = None, driver: Driver | None = None,
          catalog: Catalog | None = None) -> Services:
    """Open the store (migrating it), the driver and the controller; nothing is served yet."""
    clock = clock or SystemClock()
    catalog = catalog or load_catalog(settings.catalog)
    if settings.controller:  # before the store: a bad driver or nodes file leaves no database behind
        driver = driver or make_driver(settings, clock)
    db = Database(settings.db_url)  # a SQLite file in a new data dir makes that 0700 itself
    db.migrate()
    private_dir(settings.data_dir)  # the store answers: now the dir of its keys and spool, 0700 before they are
    controller = None
    if settings.controller:
        assert driver is not None
        controller = Controller(db, driver, catalog, region=settings.region,
                                clock=clock, lease_ttl_s=settings.lease_ttl_s, tick_s=settings.tick_s,
                                drain_s=settings.drain_s, sandbox_uids=settings.uid_range,
                                retention_s=settings.retention_s,
                                owner_defaults=settings.owner_defaults())
        controller.tracing = setup_tracing(settings.tracing, "tensora-control")
        if settings.driver == "kubernetes" and hasattr(driver, "watch"):  # react to objects at once
            driver.watch(controller.wake)
    storage = Storage(settings.data_dir / "files", shared=dict(settings.shared_models))
    isolation, why = isolation_of(settings)
    replica_secret = replicakeys.ensure_secret(settings.data_dir) if settings.driver == "local" else None
    keys = KeyChecker(db)
    sessions = Sessions(db, clock, keys, lifetime_s=settings.session_lifetime_s, idle_s=settings.session_idle_s)
    return Services(db=db, catalog=catalog, clock=clock, region=settings.region, keys=keys,
                    idempotency=Idempotency(db, clock), sessions=sessions, controller=controller, storage=storage,
                    isolation=isolation or None, isolation_reason=why, replica_secret=replica_secret,
                    owner_defaults=settings.owner_defaults(), metrics_listen=_metrics_sources(settings))


# the gateway's own variable (gateway.metrics_listen): ``tensora up`` sets it to its gateway's, which its HTTP
# workers inherit; under ``tensora serve``, a gateway run apart is read where the operator says
GATEWAY_METRICS_ENV = "TENSORA_GATEWAY_METRICS_LISTEN"


def _metrics_sources(settings: ServeSettings) -> dict[str, str]:
    """The listeners the operator page reads: this server's, and the gateway's that ``tensora up`` started."""
    out = {"control": settings.metrics_listen or "", "gateway": os.environ.get(GATEWAY_METRICS_ENV, "")}
    return {k: v for k, v in out.items() if v}


def _exit_clean(signum: int, frame: Any) -> None:
    raise SystemExit(0)


WORKER_SETTINGS_ENV = "TENSORA_SERVE_WORKER_SETTINGS"
CONTROLLER_HOLDER_ENV = "TENSORA_SERVE_CONTROLLER_HOLDER"
SUPERVISOR_PID_ENV = "TENSORA_SERVE_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Have this process sent SIGTERM when its parent dies, so that the HTTP workers and the gateway
    of a crashed (SIGKILLed) server do not keep its ports; exit now if ``parent`` is already gone."""
    ask = _parent_death_signal()
    if ask is not None:
        ask()
    if parent is not None and os.getppid() != parent:
        os._exit(0)


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a call (safe between fork and exec: it imports nothing) that asks for SIGTERM on the
    parent's death. Elsewhere None: a crash there leaves the children to be stopped by hand."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    term = int(signal.SIGTERM)
    return lambda: prctl(PR_SET_PDEATHSIG, term, 0, 0, 0)


def worker_settings_json(settings: ServeSettings) -> str:
    """The settings as the HTTP workers read them back: the older ``storage_quota`` folded into
    ``quotas.storage_bytes``, so that they validate again (a dump holds every field of ``quotas``, and the two
    names together are refused)."""
    folded = settings.model_copy(update={"quotas": settings.owner_defaults().quotas, "storage_quota": None})
    return folded.model_dump_json()


def worker_app() -> Any:
    """The app of one HTTP worker of ``serve --workers N``: no controller here; wakes go over a socket."""
    from tensora.api.app import create_app
    from tensora.control.wake import WakeSender, socket_path

    die_with_parent(int(os.environ.get(SUPERVISOR_PID_ENV, "0")) or None)
    settings = ServeSettings.model_validate_json(os.environ[WORKER_SETTINGS_ENV])
    services = build(settings.model_copy(update={"controller": False}))
    if settings.controller:
        services.waker = WakeSender(socket_path(settings.data_dir, settings.region))
        services.controller_holder = os.environ.get(CONTROLLER_HOLDER_ENV)
    return create_app(services, max_in_flight=settings.max_in_flight, max_body_bytes=settings.max_body_bytes,
                      run_controller=False)


def _run_workers(settings: ServeSettings, services: Services) -> None:
    """HTTP in worker processes (uvicorn's supervisor), the controller in this process.

    Even with one worker: a controller cycle over a long queue is CPU work, and in the HTTP
    process it would hold the GIL against the requests (the latency of every request would
    grow with the queue). Apart, each has a core of its own when the machine has two.
    """
    from uvicorn.supervisors import Multiprocess

    from tensora.api.server import Config, make_room
    from tensora.control.wake import WakeListener, socket_path

    limits = http_limits(settings)
    make_room(limits)  # the workers inherit it
    config = Config("tensora.serve:worker_app", limits=limits, factory=True, workers=settings.workers,
                    host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                    timeout_graceful_shutdown=10)
    # the sandboxes' listener before anything starts: a port that cannot be bound is named by its setting
    sandbox_port = settings.sandbox_listener()
    sandboxes = [listeners.listen(sandbox_port, "sandbox_port", config.backlog)] if sandbox_port is not None else []
    metrics = _metrics_listener(settings, services, multiprocess=True)
    listener = None
    if services.controller is not None:
        listener = WakeListener(socket_path(settings.data_dir, settings.region), services.controller.wake).start()
        services.controller.start()
    os.environ[WORKER_SETTINGS_ENV] = worker_settings_json(settings)
    os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())
    if services.controller is not None:
        os.environ[CONTROLLER_HOLDER_ENV] = services.controller.holder
    try:
        Multiprocess(config, sockets=[config.bind_socket(), *sandboxes]).run()
    finally:
        if services.controller is not None:
            services.controller.stop()
        if listener is not None:
            listener.close()
        if metrics is not None:
            metrics.close()




def _metrics_listener(settings: ServeSettings, services: Services, *, multiprocess: bool) -> Any:
    """``metrics_listen``: the API's metrics and the controller's, started; None when off. ``multiprocess``: the
    API runs in worker processes started after this (uvicorn's supervisor), each writing its counts to a private
    temporary dir (prometheus-client's multiprocess mode; not the data dir, which a request must not change),
    summed at each scrape and removed with the listener."""
    if not settings.metrics_listen:
        return None
    from tensora.scrape import Listener

    collectors: list[Any] = []
    path = None
    if multiprocess:
        import tempfile

        from prometheus_client.multiprocess import MultiProcessCollector

        path = tempfile.mkdtemp(prefix="tensora-metrics-")  # 0700
        collectors.append(MultiProcessCollector(None, path=path))  # type: ignore[no-untyped-call]
    else:
        from tensora.api.metrics import REGISTRY

        collectors.append(REGISTRY)
    if services.controller is not None:
        from tensora.control.metrics import ControllerCollector

        collectors.append(ControllerCollector())
        from tensora.drivers.local import LocalDriver

        if isinstance(services.controller.driver, LocalDriver):
            from tensora.drivers.localmetrics import LocalCollector

            collectors.append(LocalCollector(services.controller.driver))
    listener = Listener(settings.metrics_listen, *collectors, remove=path)
    if listener.start():
        if path is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # the workers inherit it, before they import it
        return listener
    listener.close()
    return None


def gateway_settings_for(server: ServeSettings, flags: dict[str, Any] | None = None,
                         env: dict[str, str] | None = None) -> Any:
    from tensora.gateway.app import GatewaySettings

    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {"data_dir": server.data_dir, "region": server.region, "host": server.host,
                              "control_url": f"http://{_client_host(server.host)}:{server.port}",
                              **server.gateway}
    origin = dict.fromkeys(server.gateway, "gateway")
    gw = layered(GatewaySettings, values, origin, env, "TENSORA_GATEWAY_", flags or {}, field_prefix="gateway.")
    if server.driver == "local" and gw.sandbox_port is None:  # its sandboxes reach the gateway on a port apart
        gw = gw.model_copy(update={"sandbox_port": listeners.derived(gw.port)})
    return gw


def _start_gateway(gw: Any) -> Any:
    """tensora up: the gateway in a process of its own (its own core, its own event loop), reading
    routes from this server. It stops with ``tensora up``, even a crashed one; the workloads do not."""
    import subprocess

    from tensora.gateway.app import GATEWAY_SETTINGS_ENV

    env = dict(os.environ, **{GATEWAY_SETTINGS_ENV: gw.model_dump_json()})
    return subprocess.Popen([sys.executable, "-m", "tensora.gateway"], env=env,
                            preexec_fn=_parent_death_signal())


def _stop_gateway(proc: Any) -> None:
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(settings: ServeSettings, profile: str = "serve") -> None:
    """Serve until interrupted. ``profile="up"``: one machine, once per data dir, and say so."""
    from tensora.api import server as api_server
    from tensora.api.app import create_app

    gw = gateway_settings_for(settings, {"port": settings.gateway_port}) if profile == "up" else None
    # before anything is printed or written
    lock = claim_up(settings, gw.port, gw.sandbox_port) if gw is not None else None
    if gw is not None and gw.metrics_listen:
        os.environ[GATEWAY_METRICS_ENV] = gw.metrics_listen
    if profile == "up" and settings.runtimes.auto_install is None:  # a new user's machine: nothing to pre-install
        settings = settings.model_copy(update={"runtimes": settings.runtimes.model_copy(update={"auto_install": True})})
    if profile == "up" and settings.controller and settings.driver == "local":
        settings, services = _build_up(settings)
    else:
        services = build(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key_file = ensure_admin_key(services.db, settings.data_dir, services.clock.now())
    where = "PostgreSQL" if not services.db.is_sqlite else f"SQLite at {settings.db_url}"
    print(f"tensora control API on http://{settings.host}:{settings.port}  (docs: /docs)", flush=True)
    print(f"dashboard on http://{settings.host}:{settings.port}/  (sign in with an API key)", flush=True)
    print(f"region {settings.region}, driver {settings.driver}, store {where}", flush=True)
    print(f"admin key in {key_file}", flush=True)
    if settings.metrics_listen:
        print(f"metrics on http://{settings.metrics_listen}/metrics", flush=True)
    if profile == "up" and services.controller is not None:
        node = services.controller.driver.nodes()[0]
        admin_runs_the_node(services.db, node, services.clock.now())
        print(f"this machine as node {node.name}: {offered(node)}; "
              f"{running_phrase(settings.owner_defaults().quotas, bool(node.gpus))} (the admin owner: the whole "
              "node)", flush=True)
        for note in gpu_notes(node, services.controller.catalog):
            print(f"  note: {note}", flush=True)
        print(describe_isolation(services.isolation or "", services.isolation_reason), flush=True)
        print(installed_runtimes(services.controller.driver, bool(settings.runtimes.auto_install)), flush=True)
        print(f"replicas and their logs in {settings.data_dir / 'replicas'}; Ctrl-C stops the servers, "
              "not the workloads (the next `tensora up` adopts them)", flush=True)
    gateway = None
    if gw is not None:
        print(f"OpenAI-compatible gateway on http://{gw.host}:{gw.port}/v1  (the same keys)", flush=True)
        if gw.metrics_listen:
            print(f"gateway metrics on http://{gw.metrics_listen}/metrics", flush=True)
        gateway = _start_gateway(gw)
    if services.controller is not None or settings.workers > 1:
        try:
            _run_workers(settings, services)
        finally:
            if gateway is not None:
                _stop_gateway(gateway)
        if profile == "up" and services.controller is not None:
            print(left_running(services.controller.driver.observe()), flush=True)
        if lock is not None:
            lock.close()
        return
    app = create_app(services, max_in_flight=settings.max_in_flight, max_body_bytes=settings.max_body_bytes)
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again under the handler found here:
    # that shutdown was clean, so end with exit code 0 rather than die by the signal (143).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_clean)
    _metrics_listener(settings, services, multiprocess=False)
    api_server.run(app, http_limits(settings), sandbox_port=settings.sandbox_listener(), host=settings.host,
                   port=settings.port, log_level=settings.log_level, access_log=False, timeout_graceful_shutdown=10)


def http_limits(settings: ServeSettings) -> HttpLimits:
    """What one client may hold of an API worker's HTTP server (``tensora.api.server``)."""
    from tensora.api.server import HttpLimits

    return HttpLimits(max_header_bytes=settings.max_header_bytes, max_headers=settings.max_headers,
                      header_timeout_s=settings.header_timeout_s, idle_timeout_s=settings.idle_timeout_s,
                      max_connections=settings.max_connections,
                      max_connections_per_client=settings.max_connections_per_client)


def _build_up(settings: ServeSettings) -> tuple[ServeSettings, Services]:
    """``tensora up``'s build: the local driver first, so that the running quotas the config leaves unset are
    the node's (``quotas.for_node``: half of it, at least its largest class), in the settings the HTTP workers
    are given too."""
    clock = SystemClock()
    catalog = load_catalog(settings.catalog)
    driver = make_driver(settings, clock)
    quotas = for_node(settings.quotas, driver.nodes()[0], catalog)
    settings = settings.model_copy(update={"quotas": quotas})
    return settings, build(settings, clock=clock, driver=driver, catalog=catalog)


ADMIN_OWNER = "admin"
"""The owner of the admin key ``tensora up`` makes on first start: the machine's operator."""


def admin_runs_the_node(db: Database, node: Node, now: float) -> bool:
    """``tensora up``: the machine's operator (owner ``admin``) may run the whole node, while every other owner
    gets the node's share (``quotas.for_node``). Written as the admin owner's own running quotas, shown by ``GET
    /v1/owners/admin`` and changed as any owner's are, once, where an admin has not set them; whether it wrote."""
    whole: dict[str, float] = {"running_cpu": node.cpu}
    if node.gpus:  # none: the GPU quota is left as it is (``quotas.for_node``)
        whole["running_gpus"] = sum(node.gpus.values())
    with db.write() as conn:
        row = owners_repo.owner_for_update(conn, ADMIN_OWNER, now)
        if any(name in (row.quotas or {}) for name in whole):
            return False
        owners_repo.write_owner(conn, ADMIN_OWNER, {"quotas": overlay(row.quotas, whole), "updated_at": now})
    return True


def left_running(replicas: Sequence[ReplicaStatus]) -> str:
    """What ``tensora up`` says as it stops: the workloads whose replicas keep running without it."""
    alive = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.RUNNING)]
    stopping = sum(1 for r in replicas if r.state is ReplicaState.STOPPING)
    workloads = len({r.workload_id for r in alive})
    if not alive:
        text = "stopped the API and gateway; no workloads are running"
    else:
        text = (f"stopped the API and gateway; {_count(workloads, 'workload')} "
                f"{'keeps' if workloads == 1 else 'keep'} running ({_count(len(alive), 'replica')}): "
                "the next `tensora up` adopts them; to stop them, start it and run "
                "`tensora workloads stop NAME`")
    if stopping:
        text += f" ({_count(stopping, 'replica')} still stopping: the next `tensora up` sees it through)"
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# -- one tensora up per data dir, and free ports ----------------------------------------------

def claim_up(settings: ServeSettings, gateway_port: int, gateway_sandbox_port: int | None = None) -> IO[str]:
    """Check that nothing holds this data dir or the ports, then hold the data dir's lock for as long
    as the returned file stays open (the process's life; the OS drops it however that ends).

    Occupied when another ``tensora up`` holds the lock, or a port is in use (by a Tensora, or
    by another program, naming the flag that chooses another); nothing is written until then."""
    import fcntl

    path = settings.data_dir / UP_LOCK_FILE
    # 1. another tensora up on this data dir
    holder = _lock_holder(path)
    if holder is not None:
        raise Occupied(_already_running(holder.get("api"), holder.get("pid")))
    # 2. the ports: free, or held by a Tensora (another data dir), or by another program
    for port, flag in ((settings.port, "--port"), (gateway_port, "--gateway-port")):
        _check_port(settings.host, port, flag)
    sandboxes = ((settings.sandbox_listener(), "sandbox_port"), (gateway_sandbox_port, "gateway.sandbox_port"))
    for sandbox_port, setting in sandboxes:
        if sandbox_port is not None:
            _check_port(listeners.SANDBOX_HOST, sandbox_port, setting)
    # 3. take the lock and say who holds it
    private_dir(settings.data_dir)
    f = path.open("a+")  # not inherited by children (close-on-exec): replicas never hold it
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        holder = _lock_holder(path) or {}
        raise Occupied(_already_running(holder.get("api"), holder.get("pid"))) from None
    f.truncate(0)
    f.write(json.dumps({"pid": os.getpid(), "api": f"{_client_host(settings.host)}:{settings.port}",
                        "gateway": f"{_client_host(settings.host)}:{gateway_port}"}) + "\n")
    f.flush()
    return f


def _already_running(api: str | None, pid: int | None) -> str:
    return f"Tensora is already running on {api or 'this data dir'}" + (f" (pid {pid})" if pid else "")


def _lock_holder(path: Path) -> dict[str, Any] | None:
    """What ``up.pid`` says when a live process holds its lock, else None (absent, or left by a
    process that is gone)."""
    import fcntl

    try:
        f = path.open("r")
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pass
        else:
            return None  # nobody holds it: a stale file
        for _ in range(20):  # its holder writes it just after taking the lock
            f.seek(0)
            with contextlib.suppress(ValueError):
                data = json.loads(f.read())
                if isinstance(data, dict):
                    return data
            time.sleep(0.05)
        return {}


def _check_port(host: str, port: int, flag: str) -> None:
    """Occupied unless this process could listen on ``host:port``."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Occupied(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no owner
        try:
            s.bind(address)
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise Occupied(f"cannot listen on {host}:{port} ({exc.strerror}): choose another with {flag}") \
                    from None
    if _is_tensora(_client_host(host), port):
        raise Occupied(_already_running(f"{_client_host(host)}:{port}", _listener_pid(port)))
    raise Occupied(f"port {port} is in use by another program (not Tensora): choose another with {flag}")


def _is_tensora(host: str, port: int) -> bool:
    """Whether a Tensora control API or gateway answers there (their /readyz bodies say so)."""
    import httpx

    try:
        body = httpx.get(f"http://{host}:{port}/readyz", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(body, dict) and ("controller" in body or "routes" in body)


def _listener_pid(port: int) -> int | None:
    """Linux: the process listening on TCP ``port`` (the eldest, where workers share its socket)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    pids: set[int] = set()
    for proc in Path("/proc").iterdir() if inodes else ():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.add(int(proc.name))
    for pid in sorted(pids):  # the one whose parent does not share the socket: the server, not a worker
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid not in pids:
                return pid
    return min(pids) if pids else None
