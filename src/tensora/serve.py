"""``tensora serve`` and ``tensora up``: the composition root, where the store, the driver, the controller, the
control API and the gateway are built and wired (one region; the controller in this process, the HTTP in
worker processes, ``tensora up``'s gateway in one of its own). It stays at the top of the package: it imports
every layer, and the layers' contracts (pyproject.toml) forbid them to import it. How these processes run on the
machine (children, the ``up`` lock, the port checks) is ``tensora.serving``'s.

Settings come from, in rising precedence: defaults, a YAML config file (``--config``),
environment variables ``TENSORA_<SETTING>`` (e.g. ``TENSORA_DATABASE_URL``), and flags.
The database defaults to ``DATA_DIR/tensora.db`` (SQLite, WAL); a ``postgresql://`` URL
selects PostgreSQL. On first start an admin key is created and written to
``DATA_DIR/admin-key`` (mode 0600); the secret is never printed or logged.

``tensora up`` (``profile="up"``) is one per data dir (``tensora.serving.uplock``): a second one, or one whose
port is taken, stops before it prints or writes anything.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensora import listeners
from tensora.api.auth import KeyChecker, create_key
from tensora.api.idempotency import Idempotency
from tensora.api.services import Services
from tensora.api.sessions import Sessions
from tensora.clock import Clock, SystemClock
from tensora.config.catalog import load_catalog
from tensora.config.quotas import for_node, overlay, running_phrase
from tensora.config.settings import (
    ADMIN_KEY_FILE,
    ServeSettings,
    describe_isolation,
    isolation_of,
    layered,
    load_settings,
)
from tensora.control.controller import Controller
from tensora.drivers.base import Driver
from tensora.drivers.hardware import gpu_notes, offered
from tensora.errors import ConfigError
from tensora.keys import replicakeys
from tensora.keys.apikeys import digest, well_formed
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.serving.banner import Named, adopted, installed_runtimes, left_running
from tensora.serving.ports import client_host
from tensora.serving.supervision import die_with_parent, start_gateway, stop_gateway
from tensora.serving.uplock import claim_up
from tensora.serving.workers import WorkerBrief, worker_settings_json
from tensora.storage import Storage
from tensora.store import keys as keys_repo
from tensora.store import owners as owners_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database, private_dir
from tensora.telemetry.scrape import check_free
from tensora.telemetry.tracing import setup as setup_tracing
from tensora.units import parse_memory

if TYPE_CHECKING:
    from tensora.api.server import HttpLimits


def load_gateway_settings(config: Path | None, flags: dict[str, Any],
                          env: dict[str, str] | None = None) -> Any:
    """``tensora gateway``: the config file's ``gateway:`` section, TENSORA_GATEWAY_* env, flags;
    ``data_dir``, region and the control API's address are the server's unless set there."""
    server = load_settings(config, {"data_dir": flags.get("data_dir")}, env)
    return gateway_settings_for(server, flags, env)


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
          catalog: Catalog | None = None, gateway_metrics_listen: str | None = None) -> Services:
    """Open the store (migrating it), the driver and the controller; nothing is served yet.
    ``gateway_metrics_listen``: the gateway's metrics listener, for the operator page (:func:`gateway_metrics`)."""
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
                    owner_defaults=settings.owner_defaults(), runs_models=settings.driver != "simulated",
                    metrics_listen=_metrics_sources(settings, gateway_metrics(gateway_metrics_listen)))


DUPLICATES_SHOWN = 20
"""At most this many duplicated names are listed at start, then how many more there are."""


def duplicated_names(db: Database) -> list[str]:
    """What ``serve`` and ``up`` say once as they start about each owner's names that several of its workloads not
    deleted hold (made before names were unique): each keeps working by its id, and a create of that name is 409
    until all but one are deleted. Nothing when there are none."""
    with db.read() as conn:
        dups = workloads_repo.duplicate_names(conn)
    lines = [f"note: owner {d.owner!r} has {len(d.ids)} workloads called {d.name!r} ({', '.join(d.ids)}), made "
             "before names were unique: each keeps working by its id; delete all but one to use the name alone"
             for d in dups[:DUPLICATES_SHOWN]]
    if len(dups) > DUPLICATES_SHOWN:
        lines.append(f"note: and {len(dups) - DUPLICATES_SHOWN} more duplicated names (tensora workloads list)")
    return lines


GATEWAY_METRICS_ENV = "TENSORA_GATEWAY_METRICS_LISTEN"
"""The gateway's own variable (``gateway.metrics_listen``): under ``tensora serve``, where the operator says a
gateway run apart has its metrics."""


def gateway_metrics(listen: str | None) -> str:
    """The gateway metrics listener the operator page reads: ``listen`` (``tensora up``'s gateway's, "" for none),
    or, when None, the one :data:`GATEWAY_METRICS_ENV` names."""
    return os.environ.get(GATEWAY_METRICS_ENV, "") if listen is None else listen


def _metrics_sources(settings: ServeSettings, gateway: str) -> dict[str, str]:
    """The listeners the operator page reads: this server's, and the gateway's."""
    out = {"control": settings.metrics_listen or "", "gateway": gateway}
    return {k: v for k, v in out.items() if v}


def _exit_clean(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def worker_app(brief: WorkerBrief) -> Any:
    """The app of one HTTP worker of ``serve --workers N``: no controller here; wakes go over a socket."""
    from tensora.api.app import create_app
    from tensora.control.wake import WakeSender, socket_path

    die_with_parent(brief.supervisor_pid or None)
    settings = brief.settings()
    services = build(settings.model_copy(update={"controller": False}),
                     gateway_metrics_listen=brief.gateway_metrics_listen)
    if settings.controller:
        services.waker = WakeSender(socket_path(settings.data_dir, settings.region))
        services.controller_holder = brief.controller_holder
    return create_app(services, max_in_flight=settings.max_in_flight, max_body_bytes=settings.max_body_bytes,
                      run_controller=False)


def _run_workers(settings: ServeSettings, services: Services, gateway_metrics_listen: str | None) -> None:
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
    holder = services.controller.holder if services.controller is not None else None
    brief = WorkerBrief(worker_settings_json(settings), os.getpid(), holder, gateway_metrics(gateway_metrics_listen))
    # the factory and its argument are pickled to each worker (multiprocessing's spawn): neither argv nor environ
    config = Config(functools.partial(worker_app, brief), limits=limits, factory=True, workers=settings.workers,
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
    from tensora.telemetry.scrape import Listener

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

        collectors.append(ControllerCollector(services.controller.metrics))
        from tensora.drivers.local import LocalDriver

        if isinstance(services.controller.driver, LocalDriver):
            from tensora.drivers.localmetrics import LocalCollector

            collectors.append(LocalCollector(services.controller.driver))
    listener = Listener(settings.metrics_listen, *collectors, remove=path)
    try:
        listener.start("metrics_listen")  # taken: the server does not start (ConfigError naming the setting)
    except ConfigError:
        listener.close()
        raise
    if path is not None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # the workers inherit it, before they import it
    return listener


def gateway_settings_for(server: ServeSettings, flags: dict[str, Any] | None = None,
                         env: dict[str, str] | None = None) -> Any:
    from tensora.gateway.app import GatewaySettings

    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {"data_dir": server.data_dir, "region": server.region, "host": server.host,
                              "control_url": f"http://{client_host(server.host)}:{server.port}",
                              **server.gateway}
    origin = dict.fromkeys(server.gateway, "gateway")
    gw = layered(GatewaySettings, values, origin, env, "TENSORA_GATEWAY_", flags or {}, field_prefix="gateway.")
    if server.driver == "local" and gw.sandbox_port is None:  # its sandboxes reach the gateway on a port apart
        gw = gw.model_copy(update={"sandbox_port": listeners.derived(gw.port)})
    return gw


def run(settings: ServeSettings, profile: str = "serve") -> None:
    """Serve until interrupted. ``profile="up"``: one machine, once per data dir, and say so."""
    from tensora.api import server as api_server
    from tensora.api.app import create_app

    gw = gateway_settings_for(settings, {"port": settings.gateway_port}) if profile == "up" else None
    # before anything is printed or written
    lock = claim_up(settings, gw.port, gw.sandbox_port, gw.metrics_listen) if gw is not None else None
    if lock is None:  # (claim_up checked them, and says who holds one)
        check_free(settings.metrics_listen, "metrics_listen")
    gateway_metrics_listen = (gw.metrics_listen or "") if gw is not None else None
    if profile == "up" and settings.runtimes.auto_install is None:  # a new user's machine: nothing to pre-install
        settings = settings.model_copy(update={"runtimes": settings.runtimes.model_copy(update={"auto_install": True})})
    if profile == "up" and settings.controller and settings.driver == "local":
        settings, services = _build_up(settings, gateway_metrics_listen)
    else:
        services = build(settings, gateway_metrics_listen=gateway_metrics_listen)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key_file = ensure_admin_key(services.db, settings.data_dir, services.clock.now())
    where = "PostgreSQL" if not services.db.is_sqlite else f"SQLite at {settings.db_url}"
    print(f"tensora control API on http://{settings.host}:{settings.port}  (docs: /docs)", flush=True)
    print(f"dashboard on http://{settings.host}:{settings.port}/  (sign in with an API key)", flush=True)
    print(f"region {settings.region}, driver {settings.driver}, store {where}", flush=True)
    print(f"admin key in {key_file}", flush=True)
    for line in duplicated_names(services.db):
        print(line, flush=True)
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
        if (adopted := adopted_line(services.db, services.controller.driver)) is not None:
            print(adopted, flush=True)
        print(f"replicas and their logs in {settings.data_dir / 'replicas'}; Ctrl-C stops the servers, "
              "not the workloads (the next `tensora up` adopts them)", flush=True)
    gateway = None
    if gw is not None:
        print(f"OpenAI-compatible gateway on http://{gw.host}:{gw.port}/v1  (the same keys)", flush=True)
        if gw.metrics_listen:
            print(f"gateway metrics on http://{gw.metrics_listen}/metrics", flush=True)
        gateway = start_gateway(gw)
    if services.controller is not None or settings.workers > 1:
        try:
            _run_workers(settings, services, gateway_metrics_listen)
        finally:
            if gateway is not None:
                stop_gateway(gateway)
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


def _build_up(settings: ServeSettings, gateway_metrics_listen: str | None) -> tuple[ServeSettings, Services]:
    """``tensora up``'s build: the local driver first, so that the running quotas the config leaves unset are
    the node's (``quotas.for_node``: half of it, at least its largest class), in the settings the HTTP workers
    are given too."""
    clock = SystemClock()
    catalog = load_catalog(settings.catalog)
    driver = make_driver(settings, clock)
    quotas = for_node(settings.quotas, driver.nodes()[0], catalog)
    settings = settings.model_copy(update={"quotas": quotas})
    return settings, build(settings, clock=clock, driver=driver, catalog=catalog,
                           gateway_metrics_listen=gateway_metrics_listen)


def adopted_line(db: Database, driver: Driver) -> str | None:
    """``tensora up``'s line on the replicas a previous run left running, which the driver adopted as it was
    made: their workloads by name and kind, read from the store (``banner.adopted``)."""
    replicas = driver.observe()
    ids = {r.workload_id for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.RUNNING)}
    names: dict[str, Named] = {}
    with db.read() as conn:
        for wid in ids:
            w = workloads_repo.get_workload(conn, wid, include_deleted=True)
            if w is not None:
                names[wid] = Named(w.name, WorkloadKind(w.kind))
    return adopted(replicas, names)


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
