"""Every replica in a sandbox, tried as an attacker would: code run in a non-admin owner's notebook kernel (over
Jupyter's kernel WebSocket, as a browser would) against ``tensora up``, out-of-memory kills, adoption after a
``kill -9``, and where the host cannot sandbox. Plus what a replica runs and sees, as values."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import websockets.sync.client

from tensora.config.catalog import default_catalog, load_catalog
from tensora.config.settings import ServeSettings, describe_isolation, isolation_of
from tensora.drivers import launch as plan
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import Isolation, LocalDriver
from tensora.drivers.loopback import Origin
from tensora.drivers.vmdisk import DiskFormat, ImageInfo, Layer
from tensora.models import runtimes
from tensora.models.tinymodel import write_tiny_model
from tensora.placement.capacity import Node
from tensora.placement.catalog import ComputeClass, Kind
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.sandbox import Limits, Mount, Runc, SandboxSpec
from tests.support import services
from tests.support.stack import stack
from tests.support.up import api_client, key_for, needs_sandbox, runc_of, start_up, tensora_up

RUN = secrets.token_hex(3)  # cgroups are host-wide (/tensora/<id>): replica ids unique to this run
UID = 160_000 + int(RUN, 16) % 5000
CPU1 = ComputeClass("cpu-1c-4g", Kind.CPU, 1, 4 << 30)
GPU = ComputeClass("l40s-48gb", Kind.GPU, 8, 64 << 30, "L40S", 1, 48 << 30)
VENV = plan.PythonEnv("/srv/tensora/venv", "/opt/python/3.11.7", "/srv/tensora/venv/bin/python", "3.11")


# -- what a replica runs and sees, as values -------------------------------------------------------------------


def _notebook(sandboxed: bool = True, **kw: Any) -> plan.Launch:
    args: dict[str, Any] = {"tensora": VENV, "home": Path("/data/workdirs/wl_1"), "private": Path("/data/replicas/r"),
                            "port": 41000, "token": "tok-secret", "cls": CPU1, "gpus": [], "sandboxed": sandboxed}
    return plan.notebook(**(args | kw))


def _endpoint(sandboxed: bool = True, **kw: Any) -> plan.Launch:
    runtime = runtimes.REGISTRY["tensora-transformers"]
    args: dict[str, Any] = {"runtime": runtime, "venv": VENV, "model": "/data/files/alice/tiny", "name": "wl_2",
                            "port": 42000, "kind": "cpu", "cls": CPU1, "gpus": [],
                            "private": Path("/data/replicas/r"), "sandboxed": sandboxed}
    return plan.endpoint(**(args | kw))


def _layer(name: str, fmt: DiskFormat) -> Layer:
    return Layer(Path("/data/files/alice") / name, name, fmt, 1 << 30, (0, 0, 0, 0))


DISK = ImageInfo(chain=(_layer("disk.qcow2", DiskFormat.QCOW2), _layer("base.raw", DiskFormat.RAW)))


def _vm(sandboxed: bool = True, **kw: Any) -> plan.Launch:
    args: dict[str, Any] = {"qemu": "/usr/bin/qemu-system-x86_64", "name": "rp_1", "cls": CPU1, "accel": "kvm",
                            "passthrough": [], "vm_dir": Path("/data/replicas/rp_1/vm"), "socket": "/vm/qmp.sock",
                            "disk": DISK, "sandboxed": sandboxed}
    return plan.vm(**(args | kw))


def _files(launch: plan.Launch) -> dict[str, tuple[str, bool]]:
    """The file nodes of a VM's disk: filename -> read-only."""
    nodes = [json.loads(launch.argv[i + 1]) for i, a in enumerate(launch.argv) if a == "-blockdev"]
    return {n["filename"]: n["read-only"] for n in nodes if n["driver"] == "file"}


def _drivers(launch: plan.Launch) -> dict[str, str]:
    nodes = [json.loads(launch.argv[i + 1]) for i, a in enumerate(launch.argv) if a == "-blockdev"]
    return {n["node-name"]: n["driver"] for n in nodes if n["driver"] != "file"}


def _mounts(launch: plan.Launch) -> dict[str, tuple[str, bool]]:
    return {m.target: (m.source, m.writable) for m in launch.mounts}


OWN = Origin("127.9.8.7", "127.9.8.7")
NAMED = Origin("127.0.0.1", "r-0123456789abcdef.localhost")
ENV_FROM_SCRATCH = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                    "MKL_NUM_THREADS"}

LAUNCH_CASES: dict[str, tuple[Callable[[], plan.Launch], Callable[[plan.Launch], bool]]] = {
    "notebook: its home read-write at /home/owner, Tensora's env and its Python read-only, nothing else": (
        _notebook, lambda x: _mounts(x) == {"/home/owner": ("/data/workdirs/wl_1", True),
                                            "/opt/tensora": ("/srv/tensora/venv", False),
                                            "/opt/python/3.11.7": ("/opt/python/3.11.7", False)}),
    "notebook: JupyterLab on 127.0.0.1 inside, from the mounted env, serving the home, not as root": (
        _notebook, lambda x: x.argv[:3] == ("/opt/tensora/bin/python", "-m", "jupyterlab")
        and "--ServerApp.ip=127.0.0.1" in x.argv and "--ServerApp.root_dir=/home/owner" in x.argv
        and "--allow-root" not in x.argv and x.cwd == "/home/owner"),
    "notebook: the token in the environment, never on argv": (
        _notebook, lambda x: x.env["JUPYTER_TOKEN"] == "tok-secret" and not any("tok-secret" in a for a in x.argv)),
    "notebook: an environment from scratch (Jupyter's dirs, pip into the home), nothing of Tensora's": (
        _notebook, lambda x: set(x.env) == ENV_FROM_SCRATCH | {"JUPYTER_TOKEN", "JUPYTER_RUNTIME_DIR", "PIP_PREFIX",
                                                               "PYTHONPATH"}
        and x.env["HOME"] == "/home/owner" and x.env["JUPYTER_RUNTIME_DIR"].startswith("/tmp/")
        and x.env["PYTHONPATH"] == "/home/owner/.local/lib/python3.11/site-packages"),
    "notebook on CPU: no GPU visible": (_notebook, lambda x: x.env["CUDA_VISIBLE_DEVICES"] == ""),
    "notebook on a GPU class: its own GPUs only, threads of its vCPUs": (
        lambda: _notebook(cls=GPU, gpus=[3]),
        lambda x: x.env["CUDA_VISIBLE_DEVICES"] == "3" and x.env["OMP_NUM_THREADS"] == "8"),
    "notebook unsandboxed as root: --allow-root, Jupyter's dirs in the replica's dir, still no token on argv": (
        lambda: _notebook(sandboxed=False, as_root=True),
        lambda x: "--allow-root" in x.argv and x.mounts == () and x.cwd == "/data/workdirs/wl_1"
        and x.env["JUPYTER_CONFIG_DIR"] == "/data/replicas/r/jupyter/config"
        and not any("tok-secret" in a for a in x.argv)),
    "notebook sandboxed: 127.0.0.1 inside, published on its own address": (
        lambda: _notebook(origin=OWN), lambda x: "--ServerApp.ip=127.0.0.1" in x.argv and x.address == "127.9.8.7"),
    "notebook unsandboxed: binds its own address itself, never 127.0.0.1": (
        lambda: _notebook(sandboxed=False, origin=OWN),
        lambda x: "--ServerApp.ip=127.9.8.7" in x.argv and x.address == "127.9.8.7"
        and not any("local_hostnames" in a for a in x.argv)),
    "notebook named (no other loopback address): the name passes Jupyter's Host check": (
        lambda: _notebook(sandboxed=False, origin=NAMED),
        lambda x: "--ServerApp.ip=127.0.0.1" in x.argv and x.address == "127.0.0.1"
        and "--ServerApp.local_hostnames=r-0123456789abcdef.localhost" in x.argv
        and "--ServerApp.local_hostnames=localhost" in x.argv),
    "endpoint unsandboxed: the model server binds its own address": (
        lambda: _endpoint(sandboxed=False, address="127.9.8.7"),
        lambda x: x.argv[x.argv.index("--host") + 1] == "127.9.8.7" and x.address == "127.9.8.7"),
    "endpoint sandboxed: 127.0.0.1 inside, published on its own address": (
        lambda: _endpoint(address="127.9.8.7"),
        lambda x: x.argv[x.argv.index("--host") + 1] == "127.0.0.1" and x.address == "127.9.8.7"),
    "endpoint: the model read-only at /model, the runtime's venv read-only, served as /model": (
        _endpoint, lambda x: _mounts(x) == {"/model": ("/data/files/alice/tiny", False),
                                            "/opt/runtime": ("/srv/tensora/venv", False),
                                            "/opt/python/3.11.7": ("/opt/python/3.11.7", False)}
        and x.served_model == "/model"),
    "endpoint: python -m from the mounted venv, on /model, 127.0.0.1 inside, no host path on argv": (
        _endpoint, lambda x: x.argv[:3] == ("/opt/runtime/bin/python", "-m", "transformers.cli.transformers")
        and x.argv[x.argv.index("serve") + 1] == "/model" and x.argv[x.argv.index("--host") + 1] == "127.0.0.1"
        and not any("/data" in a for a in x.argv)),
    "endpoint: its runtime's variables, HOME in the private /tmp": (
        _endpoint, lambda x: x.env["HF_HUB_OFFLINE"] == "1" and x.env["HOME"] == "/tmp"
        and set(x.env) == ENV_FROM_SCRATCH | set(runtimes.REGISTRY["tensora-transformers"].env)),
    "endpoint on vllm-cpu: the replica's key in VLLM_API_KEY, never on argv": (
        lambda: _endpoint(runtime=runtimes.REGISTRY["tensora-vllm-cpu"], api_key="rk-secret"),
        lambda x: x.env["VLLM_API_KEY"] == "rk-secret" and not any("rk-secret" in a for a in x.argv)
        and "--api-key" not in x.argv
        and set(x.env) == ENV_FROM_SCRATCH | set(runtimes.REGISTRY["tensora-vllm-cpu"].env) | {"VLLM_API_KEY"}),
    "endpoint on vllm (GPU), unsandboxed: the key in VLLM_API_KEY all the same": (
        lambda: _endpoint(sandboxed=False, runtime=runtimes.REGISTRY["tensora-vllm"], kind="gpu", cls=GPU, gpus=[0],
                          api_key="rk-secret"),
        lambda x: x.env["VLLM_API_KEY"] == "rk-secret" and not any("rk-secret" in a for a in x.argv)),
    "endpoint on a runtime that takes no key (transformers serve): no key anywhere": (
        lambda: _endpoint(api_key="rk-secret"),
        lambda x: "rk-secret" not in {*x.env.values(), *x.argv} and "VLLM_API_KEY" not in x.env),
    "endpoint unsandboxed: the host paths, served by its host path": (
        lambda: _endpoint(sandboxed=False),
        lambda x: x.mounts == () and x.served_model == "/data/files/alice/tiny"
        and x.argv[0] == "/srv/tensora/venv/bin/python"),
    "vm: its dir read-write at /vm (QMP socket, console, the overlay), each image of the chain alone read-only": (
        _vm, lambda x: _mounts(x) == {"/vm": ("/data/replicas/rp_1/vm", True),
                                      "/image/0": ("/data/files/alice/disk.qcow2", False),
                                      "/image/1": ("/data/files/alice/base.raw", False)}
        and "unix:/vm/qmp.sock,server=on,wait=off" in x.argv
        and "file,id=console,path=/vm/console.log,append=on" in x.argv),
    "vm: the overlay read-write over the chain read-only, every driver named, no -drive, no snapshot": (
        _vm, lambda x: _files(x) == {"/vm/disk.qcow2": False, "/image/0": True, "/image/1": True}
        and _drivers(x) == {"disk0": "qcow2", "disk0-base1": "qcow2", "disk0-base2": "raw"}
        and "-drive" not in x.argv and not any("snapshot" in a for a in x.argv)
        and "virtio-blk-pci,drive=disk0,id=disk0-dev" in x.argv),
    "vm without a disk: no disk at all": (
        lambda: _vm(disk=None), lambda x: "-blockdev" not in x.argv and set(_mounts(x)) == {"/vm"}),
    "vm: QEMU's own seccomp sandbox on, only /dev/kvm added": (
        _vm, lambda x: x.argv[x.argv.index("-sandbox") + 1].startswith("on,") and x.devices == ("/dev/kvm",)),
    "vm on TCG: no device at all": (lambda: _vm(accel="tcg"), lambda x: x.devices == ()),
    "vm with a GPU by passthrough: the VFIO container and its group's device": (
        lambda: _vm(passthrough=["0000:65:00.0"], vfio_groups=["42"]),
        lambda x: x.devices == ("/dev/kvm", "/dev/vfio/vfio", "/dev/vfio/42")
        and "vfio-pci,host=0000:65:00.0" in x.argv),
    "vm: the guest's memory leaves room for QEMU in the class's limit": (
        _vm, lambda x: int(x.argv[x.argv.index("-m") + 1]) == 3584),
    "vm unsandboxed: the same disk nodes at host paths, no -sandbox (QEMU runs as Tensora's user)": (
        lambda: _vm(sandboxed=False, socket="/tmp/tensora-qmp-x.sock"),
        lambda x: _files(x) == {"/data/replicas/rp_1/vm/disk.qcow2": False, "/data/files/alice/disk.qcow2": True,
                                "/data/files/alice/base.raw": True}
        and x.mounts == () and "-drive" not in x.argv and "-sandbox" not in x.argv),
}


@pytest.mark.parametrize("case", LAUNCH_CASES.values(), ids=LAUNCH_CASES.keys())
def test_launch(case: tuple[Callable[[], plan.Launch], Callable[[plan.Launch], bool]]) -> None:
    build, check = case
    launch = build()
    assert check(launch), launch


PYTHON_CASES = {
    "a venv at the target, its base at its own path": (
        VENV, ((Mount("/srv/tensora/venv", "/opt/x"), Mount("/opt/python/3.11.7", "/opt/python/3.11.7")),
               "/opt/x/bin/python")),
    "a base under /usr is shown already": (
        plan.PythonEnv("/srv/v", "/usr", "/srv/v/bin/python"), ((Mount("/srv/v", "/opt/x"),), "/opt/x/bin/python")),
    "no venv: the installation at its own path, its own interpreter": (
        plan.PythonEnv("/opt/py", "/opt/py", "/opt/py/bin/python3"), ((Mount("/opt/py", "/opt/py"),),
                                                                     "/opt/py/bin/python3")),
}


@pytest.mark.parametrize("case", PYTHON_CASES.values(), ids=PYTHON_CASES.keys())
def test_python_mounts(case: tuple[plan.PythonEnv, Any]) -> None:
    env, want = case
    assert plan.python_mounts(env, "/opt/x") == want


def test_a_python_under_tmp_cannot_be_shown_and_says_so() -> None:
    with pytest.raises(plan.LaunchError, match="/tmp"):
        plan.python_mounts(plan.PythonEnv("/srv/v", "/tmp/py", "/srv/v/bin/python"), "/opt/x")


CPUSET_CASES = {  # (cores, taken, want, overcommitted) -> cores
    "overcommitted node: no cpuset, the quota alone": (([0, 1, 2, 3], set(), 2, True), []),
    "whole cores free: the highest": (([0, 1, 2, 3], set(), 2, False), [2, 3]),
    "some taken: the highest free": (([0, 1, 2, 3], {3}, 2, False), [1, 2]),
    "too few free: none": (([0, 1, 2, 3], {1, 2, 3}, 2, False), []),
    "a fraction of a core: none": (([0, 1, 2, 3], set(), 0.5, False), []),
}


@pytest.mark.parametrize("case", CPUSET_CASES.values(), ids=CPUSET_CASES.keys())
def test_choose_cpuset(case: tuple[tuple[list[int], set[int], float, bool], list[int]]) -> None:
    (cores, taken, want, over), expected = case
    assert plan.choose_cpuset(cores, taken, want, overcommitted=over) == expected


def test_the_sandbox_publishes_its_port_and_reaches_only_tensoras_ports() -> None:
    forwards = [(8701, 8721), (8700, 8720), (0, 8722), (41000, 41000)]  # an unset port, and the replica's own
    spec = plan.sandbox_spec(_notebook(), "rp_1", 100_001, 100_001, plan.limits(CPU1, [2]), [], forwards)
    assert spec.publish == ((41000, 41000),) and spec.allow_host_ports == ((8700, 8720), (8701, 8721))
    mine = plan.sandbox_spec(_notebook(origin=OWN), "rp_1", 100_001, 100_001, plan.limits(CPU1), [], [(8700, 8720)])
    assert mine.publish_address == "127.9.8.7"  # its own address, not Tensora's
    assert (spec.uid, spec.gid, spec.limits.cpus, spec.limits.memory_bytes) == (100_001, 100_001, 1, 4 << 30)
    assert spec.limits.cpuset == "2" and spec.limits.pids == plan.PIDS


ISOLATION_CASES = {  # (driver, isolation setting, why the host cannot sandbox) -> (mode, reason)
    "local, sandbox, the host can: sandbox": (("local", "sandbox", None), ("sandbox", None)),
    "local, sandbox, the host cannot: the admin owner only, and why": (
        ("local", "sandbox", "no runc on PATH"), ("admin-only", "no runc on PATH")),
    "local, none by the operator: none, whatever the host": (("local", "none", None), ("none", None)),
    "another driver: not the local driver's business": (("simulated", "sandbox", None), ("", None)),
}


@pytest.mark.parametrize("case", ISOLATION_CASES.values(), ids=ISOLATION_CASES.keys())
def test_isolation_of(case: tuple[tuple[str, str, str | None], tuple[str, str | None]], tmp_path: Path) -> None:
    (driver, isolation, why), want = case
    settings = ServeSettings(data_dir=tmp_path, driver=driver, isolation=isolation)  # type: ignore[arg-type]
    assert isolation_of(settings, lambda: why) == want


def test_the_isolation_reads_plainly() -> None:
    assert "unsandboxed" in describe_isolation("none", None)
    text = describe_isolation("admin-only", "no runc on PATH")
    assert "no runc on PATH" in text and "admin owner only" in text and "isolation: none" in text


@pytest.mark.parametrize("mode", ["admin-only", "none"])
def test_where_the_host_cannot_sandbox_only_the_admin_owner_creates(tmp_path: Path, mode: str) -> None:
    s = stack(str(tmp_path / "t.db"), tmp_path, run_controller=False)
    s.services.isolation, s.services.isolation_reason = mode, "no runc on PATH (Debian: apt-get install runc)"
    body = {"kind": "vm", "name": "v", "gpu_class": "cpu-1c-4g"}
    with services.serving(s.app) as live, httpx.Client(base_url=live.url, timeout=10) as c:
        alice = c.post("/v1/workloads", json=body, headers=s.headers(s.alice))
        for_alice = c.post("/v1/workloads", json=body | {"name": "v2", "owner": "alice"}, headers=s.headers(s.admin))
        admin = c.post("/v1/workloads", json=body | {"name": "v3"}, headers=s.headers(s.admin))
        catalog = c.get("/v1/catalog", headers=s.headers(s.alice)).json()
    assert admin.status_code == 201 and catalog["isolation"] == mode
    if mode == "none":  # the operator chose it: everyone runs, and the catalog says how
        assert (alice.status_code, for_alice.status_code) == (201, 201)
        return
    assert (alice.status_code, for_alice.status_code) == (403, 403)
    message = alice.json()["error"]["message"]
    assert "cannot sandbox" in message and "no runc on PATH" in message and "isolation: none" in message
    s.services.db.dispose()


def test_the_driver_refuses_other_owners_where_it_cannot_sandbox(tmp_path: Path) -> None:
    d = LocalDriver(tmp_path / "data", Node("box", "local", 4, 16 << 30), default_catalog(),
                    isolation=Isolation.ADMIN_ONLY)
    status = d.start(ReplicaSpec(f"rp_ao_{RUN}", "wl_ao", WorkloadKind.VM, "cpu-1c-4g", "box", owner="alice"))
    assert status.state is ReplicaState.FAILED and "cannot sandbox" in status.detail


def test_a_sandboxed_replica_needs_its_owners_uid(tmp_path: Path) -> None:
    d = LocalDriver(tmp_path / "data", Node("box", "local", 4, 16 << 30), default_catalog(),
                    runc=Runc(tmp_path / "r", tmp_path / "b"))
    status = d.start(ReplicaSpec(f"rp_nouid_{RUN}", "wl_n", WorkloadKind.VM, "cpu-1c-4g", "box", owner="alice"))
    assert status.state is ReplicaState.FAILED and "no sandbox uid for owner 'alice'" in status.detail


# -- a notebook kernel, driven as a browser drives it ---------------------------------------------------------


@dataclass
class Ran:
    out: str
    end: str
    """``idle`` (it ran), ``error: ...`` (it raised) or ``died`` (the kernel was killed: restarting, closed)."""


def kernel_run(base: str, token: str, code: str, timeout: float = 60) -> Ran:
    """Run ``code`` in a new kernel of the JupyterLab at ``base``: POST /api/kernels, then an execute_request on
    the kernel's ``channels`` WebSocket; the stream output and how it ended."""
    kernel = httpx.post(f"{base}/api/kernels", params={"token": token}, json={}, timeout=30)
    assert kernel.status_code == 201, kernel.text
    url = f"{base.replace('http', 'ws', 1)}/api/kernels/{kernel.json()['id']}/channels?token={token}"
    msg_id, out = uuid.uuid4().hex, []
    request = {"header": {"msg_id": msg_id, "username": "tenant", "session": uuid.uuid4().hex,
                          "msg_type": "execute_request", "version": "5.3"},
               "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
               "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                           "allow_stdin": False, "stop_on_error": True}}
    deadline = time.monotonic() + timeout
    with websockets.sync.client.connect(url, open_timeout=30, max_size=None) as ws:
        ws.send(json.dumps(request))
        while True:
            try:
                msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            except websockets.exceptions.ConnectionClosed:
                return Ran("".join(out), "died")
            kind, content = msg.get("msg_type"), msg.get("content", {})
            if kind == "status" and content.get("execution_state") in ("restarting", "dead"):
                return Ran("".join(out), "died")
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                return Ran("".join(out), f"error: {content.get('ename')}: {content.get('evalue')}")
            elif kind == "status" and content.get("execution_state") == "idle":
                return Ran("".join(out), "idle")


PROBE = r"""
import errno, glob, json, os, socket, urllib.request
P = json.loads(%r)
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def reach(port, host="127.0.0.1"):
    try:
        with socket.create_connection((host, port), timeout=3):
            return "ok"
    except OSError as e:
        return type(e).__name__
out = {"uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd(), "env": sorted(os.environ)}
for name, path in P["files"].items():
    out[name] = attempt(lambda: open(path, "rb").read(1) if not os.path.isdir(path) else os.listdir(path))
out["relative admin key"] = attempt(lambda: open("../../admin-key").read())
v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
read = lambda p: open(p).read().split()
if v2:
    out["memory"] = int(read("/sys/fs/cgroup/memory.max")[0])
    out["cpu"] = [int(x) for x in read("/sys/fs/cgroup/cpu.max")]
else:
    out["memory"] = int(read("/sys/fs/cgroup/memory/memory.limit_in_bytes")[0])
    out["cpu"] = [int(read(f"/sys/fs/cgroup/cpu/cpu.cfs_{f}_us")[0]) for f in ("quota", "period")]
out["routes"] = [l.split()[:2] for l in open("/proc/net/route").read().splitlines()[1:]]
out["token on argv"] = [p for p in glob.glob("/proc/[0-9]*/cmdline")
                        if P["token"].encode() in open(p, "rb").read()]
out["processes"] = len(glob.glob("/proc/[0-9]*"))
out["ports"] = {name: reach(port) for name, port in P["ports"].items()}
out["hosts"] = {name: reach(port, host) for name, (host, port) in P.get("hosts", {}).items()}
out["api"] = urllib.request.urlopen(P["api"], timeout=5).status
print(json.dumps(out))
"""


# -- tensora up, a non-admin tenant's view -------------------------------------------------------------------

def _state(c: httpx.Client, wid: str, states: set[str], deadline_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while True:
        w: dict[str, Any] = c.get(f"/v1/workloads/{wid}").json()
        if w["state"] in states:
            return w
        assert time.monotonic() < deadline, w
        time.sleep(0.3)


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stand_in_server() -> tuple[int, Callable[[], None]]:
    """A private service on the host's loopback (a database, Redis): answers anyone who connects."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = srv.accept()
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join()
        srv.close()

    return int(srv.getsockname()[1]), close


def _token_port(url: str) -> tuple[str, str, int]:
    parsed = httpx.URL(url)
    return str(parsed.params["token"]), parsed.host, int(parsed.port or 0)


@pytest.mark.slow
@needs_sandbox
def test_a_tenants_notebook_kernel_reaches_nothing_of_tensora_or_other_tenants(tmp_path: Path) -> None:
    private_port, close_private = _stand_in_server()
    with tensora_up(tmp_path) as (_, log, port, _gw), contextlib.ExitStack() as stack_:
        stack_.callback(close_private)
        data = tmp_path / "data"
        admin = stack_.enter_context(api_client(port, (data / "admin-key").read_text().strip()))
        assert "isolation: sandbox" in log.read_text()
        assert admin.get("/v1/catalog").json()["isolation"] == "sandbox"
        alice = stack_.enter_context(api_client(port, key_for(admin, "alice")))
        bob = stack_.enter_context(api_client(port, key_for(admin, "bob")))
        ids = {who: c.post("/v1/workloads", json={"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}
                           ).json()["id"] for who, c in (("alice", alice), ("bob", bob))}
        mine = _state(alice, ids["alice"], {"running", "failed"})
        theirs = _state(bob, ids["bob"], {"running", "failed"})
        assert (mine["state"], theirs["state"]) == ("running", "running"), (mine, theirs)
        token, nb_host, nb_port = _token_port(mine["access"]["url"])
        _, bob_host, bob_port = _token_port(theirs["access"]["url"])
        # each on a loopback address of its own: neither Tensora's 127.0.0.1 nor the other's
        assert len({"127.0.0.1", nb_host, bob_host}) == 3, (nb_host, bob_host)
        alice_home, bob_home = data / "workdirs" / ids["alice"], data / "workdirs" / ids["bob"]
        (bob_home / "secret.txt").write_text("bob's")
        os.chown(bob_home / "secret.txt", bob_home.stat().st_uid, bob_home.stat().st_gid)
        probe = {"token": token, "api": f"http://127.0.0.1:{port}/readyz",
                 "files": {"data dir": str(data), "admin key": str(data / "admin-key"),
                           "database": str(data / "tensora.db"), "bob's home": str(bob_home),
                           "bob's file": str(bob_home / "secret.txt"), "replicas": str(data / "replicas")},
                 "ports": {"bob's notebook": bob_port, "a private host service": private_port,
                           "the control API": port},
                 "hosts": {"bob's notebook at its address": (bob_host, bob_port)}}
        ran = kernel_run(f"http://{nb_host}:{nb_port}", token, PROBE % json.dumps(probe))
        assert ran.end == "idle", ran
        seen = json.loads(ran.out)
        # 1. identity: the owner's own uid, never root, not bob's
        uid = alice_home.stat().st_uid
        assert seen["uid"] == uid == seen["gid"] and 100_000 <= uid <= 165_535
        assert bob_home.stat().st_uid not in (uid, 0)
        # 2. files: nothing of DATA_DIR, nor the other tenant's home
        for name in probe["files"]:
            assert seen[name] == "ENOENT", (name, seen[name])
        assert seen["relative admin key"] == "ENOENT" and seen["cwd"] == "/home/owner"
        # 3. environment: nothing of Tensora's
        assert not [k for k in seen["env"] if k.startswith("TENSORA")], seen["env"]
        assert not {"DATABASE_URL", "PYTHONSTARTUP", "VIRTUAL_ENV"} & set(seen["env"])
        # 4. limits: the class's memory and vCPUs
        assert seen["memory"] == 4 << 30 and seen["cpu"] == [100_000, 100_000]
        # 5. network: a default route out; the API (which checks keys) reachable; nothing else on the host
        assert any(dest == "00000000" for _, dest in seen["routes"]), seen["routes"]
        assert seen["api"] == 200 and seen["ports"]["the control API"] == "ok"
        assert seen["ports"]["bob's notebook"] == "ConnectionRefusedError"
        assert seen["hosts"]["bob's notebook at its address"] == "ConnectionRefusedError"
        assert seen["ports"]["a private host service"] == "ConnectionRefusedError"
        # 6. secrets: the token on no process's argv, inside or on the host; replica.json 0600 in a 0700 dir
        assert seen["token on argv"] == []
        on_argv = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if token.encode() in cmdline.read_bytes():
                    on_argv.append(cmdline)
        assert on_argv == []
        for meta in (data / "replicas").glob("*/replica.json"):
            assert stat.S_IMODE(meta.stat().st_mode) == 0o600
            assert stat.S_IMODE(meta.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((data / "replicas").stat().st_mode) == 0o700
        # 7. a pid namespace of its own: the notebook's processes only
        assert seen["processes"] < 10


@pytest.mark.slow
@needs_sandbox
def test_an_uploaded_model_served_in_a_sandbox_answers_through_the_gateway(tmp_path: Path) -> None:
    root = os.environ.get("TENSORA_RUNTIMES_DIR")
    if not root:
        pytest.skip("TENSORA_RUNTIMES_DIR is not set: ./scripts/test installs tensora-transformers there")
    from tensora.sdk import Client

    write_tiny_model(tmp_path / "tiny")
    with tensora_up(tmp_path) as (_, log, port, gw_port), contextlib.ExitStack() as stack_:
        data = tmp_path / "data"
        admin = stack_.enter_context(api_client(port, (data / "admin-key").read_text().strip()))
        key = key_for(admin, "carol")
        carol = stack_.enter_context(api_client(port, key))
        with Client(key, f"http://127.0.0.1:{port}") as sdk:
            sdk.upload_dir(tmp_path / "tiny", "tiny")
        made = carol.post("/v1/workloads", json={"kind": "endpoint", "name": "chat", "gpu_class": "cpu-1c-4g",
                                                 "model": "tiny"})
        assert made.status_code == 201, made.text
        ep = _state(carol, made.json()["id"], {"running", "failed"}, 120)
        assert ep["state"] == "running", (ep, log.read_text()[-2000:])
        route = admin.get("/v1/gateway/routes").json()["endpoints"][0]["replicas"][0]
        assert route["upstream_model"] == "/model"  # the name the sandboxed server answers to
        meta = json.loads(next((data / "replicas").glob("*/replica.json")).read_text())
        assert Path(f"/proc/{meta['pid']}").stat().st_uid == meta["uid"] != 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key=key, max_retries=0, timeout=60)
        deadline = time.monotonic() + 20
        while True:  # the gateway has the route within its poll interval
            try:
                out = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and time.monotonic() < deadline, exc
                time.sleep(0.3)
        assert out.model == "chat" and out.usage is not None and out.usage.completion_tokens == 4


@pytest.mark.slow
@needs_sandbox
def test_kill_9_of_tensora_up_then_up_adopts_every_sandbox_and_leaves_no_orphan(tmp_path: Path) -> None:
    with tensora_up(tmp_path) as (proc, _log, port, gw_port):
        data = tmp_path / "data"
        key = (data / "admin-key").read_text().strip()
        with api_client(port, key) as c:
            ids = [c.post("/v1/workloads", json={"kind": kind, "name": kind, "gpu_class": "cpu-1c-4g"}).json()["id"]
                   for kind in ("notebook", "vm")]
            before = {wid: _state(c, wid, {"running", "failed"}) for wid in ids}
        assert {w["state"] for w in before.values()} == {"running"}, before
        runner = runc_of(data)
        metas = [json.loads(m.read_text()) for m in (data / "replicas").glob("*/replica.json")]
        replicas = sorted(m["id"] for m in metas)
        assert len(replicas) == 2 and runner.list() == replicas
        # a sandbox no replica claims (as a crash in the middle of a start would leave)
        orphan = f"orphan-{RUN}"
        runner.start(SandboxSpec(id=orphan, argv=("/usr/bin/sleep", "600"), uid=UID, gid=UID,
                                 limits=Limits(cpus=0.1, memory_bytes=64 << 20), env={"PATH": "/usr/bin"}))
        proc.kill()  # kill -9
        proc.wait(10)
        deadline = time.monotonic() + 20
        while _answers(port) or _answers(gw_port):  # its workers and gateway end with it (a parent-death signal)
            assert time.monotonic() < deadline, "tensora up's children outlived it"
            time.sleep(0.1)
        assert runner.list() == sorted([*replicas, orphan])  # the workloads run on without it
        again, _ = start_up(tmp_path, port, gw_port, 1)
        try:
            with api_client(port, key) as c:
                for wid, w in before.items():
                    now = _state(c, wid, {"running", "failed"})
                    assert now["state"] == "running" and now["access"] == w["access"]  # adopted, not restarted
            assert runner.list() == replicas  # the orphan is gone, the replicas adopted
            assert {m["pid"] for m in metas} == {runner.handle(r).pid for r in replicas}  # the same processes
            assert not runner.bundle(orphan).exists()
        finally:
            again.send_signal(signal.SIGINT)
            again.wait(30)


@pytest.mark.slow
@needs_sandbox
def test_a_data_dir_with_a_sandbox_left_behind_can_still_be_removed(tmp_path: Path) -> None:
    """As a test that kills its replicas' processes, or an operator's ``rm -rf``, leaves it: no mount holds the
    data dir once its sandboxes run (their network namespace is held by their processes, not a bind mount)."""
    data = tmp_path / "data"
    d = LocalDriver(data, Node("box", "local", 4, 16 << 30), default_catalog())
    rid = f"rp_left_{RUN}"
    d.start(ReplicaSpec(rid, "wl_left", WorkloadKind.VM, "cpu-1c-4g", "box", owner="alice", uid=UID, gid=UID))
    assert _wait(d, rid, {ReplicaState.RUNNING, ReplicaState.FAILED}, 30).state is ReplicaState.RUNNING
    assert not [m for m in Path("/proc/self/mountinfo").read_text().splitlines() if str(data) in m]
    handle = d.runc.handle(rid)
    assert handle is not None and handle.net_pid is not None
    os.killpg(handle.pid, signal.SIGKILL)
    try:
        shutil.rmtree(data)  # no EBUSY
    finally:  # what is left of it: its network helper, its empty cgroups
        with contextlib.suppress(ProcessLookupError):
            os.kill(handle.net_pid, signal.SIGTERM)
        left = [c / "tensora" / rid for c in Path("/sys/fs/cgroup").iterdir() if (c / "tensora" / rid).is_dir()]
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:  # emptied once the killed processes are gone
            for cgroup in list(left):
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
                    left.remove(cgroup)
            time.sleep(0.1)


# -- out of memory ------------------------------------------------------------------------------------------------

TINY = """classes:
  - {name: cpu-tiny-512m, kind: cpu, cpu: 1, memory: 512Mi}
  - {name: cpu-tiny-256m, kind: cpu, cpu: 1, memory: 256Mi}
"""
HOG = "x = bytearray(1 << 30)\nfor i in range(0, len(x), 4096): x[i] = 1\n"


def _wait(d: LocalDriver, rid: str, states: set[ReplicaState], deadline_s: float = 60,
          until: Callable[[Any], bool] = lambda s: True) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        seen = {s.id: s for s in d.observe()}.get(rid)
        if seen is not None and seen.state in states and until(seen):
            return seen
        assert time.monotonic() < deadline, f"{rid} not {states} in {deadline_s}s: {seen}"
        time.sleep(0.2)


@pytest.fixture
def tiny_driver(tmp_path: Path) -> Iterator[LocalDriver]:
    (tmp_path / "catalog.yaml").write_text(TINY)
    d = LocalDriver(tmp_path / "data", Node("box", "local", 4, 16 << 30), load_catalog(tmp_path / "catalog.yaml"),
                    runtimes_dir=tmp_path / "runtimes")
    yield d
    for sandbox_id in d.runc.list():
        d.runc.delete(sandbox_id)


@pytest.mark.slow
@needs_sandbox
def test_a_kernel_past_its_class_memory_is_killed_and_the_replica_says_so(tiny_driver: LocalDriver) -> None:
    rid = f"rp_oomnb_{RUN}"
    tiny_driver.start(ReplicaSpec(rid, "wl_oom", WorkloadKind.NOTEBOOK, "cpu-tiny-512m", "box", owner="alice",
                                  uid=UID, gid=UID))
    assert _wait(tiny_driver, rid, {ReplicaState.RUNNING, ReplicaState.FAILED}).state is ReplicaState.RUNNING
    meta = tiny_driver._read(rid)
    assert meta is not None
    ran = kernel_run(f"http://{meta['address']}:{meta['port']}", meta["token"], HOG)
    assert ran.end == "died", ran
    seen = _wait(tiny_driver, rid, {ReplicaState.RUNNING}, 10, lambda s: "out of memory" in s.detail)
    assert seen.detail.startswith("out of memory: limit 512Mi of cpu-tiny-512m"), seen.detail


def _fake_runtime(root: Path, code: str) -> None:
    """A 'tensora-transformers' whose server is ``code``: a venv (made by hand, of Debian's Python under /usr)
    with a ``transformers.cli.transformers`` module."""
    venv = runtimes.venv_dir(root, "tensora-transformers")
    system = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    package = venv / "lib" / f"python{system}" / "site-packages" / "transformers"
    (package / "cli").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli" / "__init__.py").write_text("")
    (package / "cli" / "transformers.py").write_text(code)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    for p in [venv, *venv.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    (root / "tensora-transformers" / "installed.json").write_text("{}")


@pytest.mark.slow
@needs_sandbox
def test_a_server_past_its_class_memory_fails_the_replica_with_the_reason(tiny_driver: LocalDriver,
                                                                          tmp_path: Path) -> None:
    _fake_runtime(tiny_driver.runtimes, HOG)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rid = f"rp_oomep_{RUN}"
    tiny_driver.start(ReplicaSpec(rid, "wl_oomep", WorkloadKind.ENDPOINT, "cpu-tiny-256m", "box", str(model),
                                  owner="alice", uid=UID, gid=UID))
    failed = _wait(tiny_driver, rid, {ReplicaState.FAILED, ReplicaState.STOPPED}, 30)
    assert (failed.state, failed.detail) == (ReplicaState.FAILED, "out of memory: limit 256Mi of cpu-tiny-256m")
    assert tiny_driver.runc.list() == []  # read, then deleted


def test_a_model_not_readable_by_the_sandbox_is_refused_with_the_file(tmp_path: Path) -> None:
    (tmp_path / "rt").mkdir()
    _fake_runtime(tmp_path / "rt", "")
    model = tmp_path / "model"
    model.mkdir(mode=0o755)
    (model / "weights.safetensors").write_text("x")
    (model / "weights.safetensors").chmod(0o600)
    d = LocalDriver(tmp_path / "data", Node("box", "local", 4, 16 << 30), default_catalog(),
                    runtimes_dir=tmp_path / "rt", runc=Runc(tmp_path / "r", tmp_path / "b"))
    status = d.start(ReplicaSpec(f"rp_unread_{RUN}", "wl_u", WorkloadKind.ENDPOINT, "cpu-1c-4g", "box", str(model),
                                 owner="alice", uid=UID, gid=UID))
    assert status.state is ReplicaState.FAILED
    assert "weights.safetensors is not readable by the sandbox (mode 600" in status.detail


# -- the benchmark still runs ---------------------------------------------------------------------------------


@pytest.mark.slow
@needs_sandbox
def test_sandbox_benchmark_quick_run(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "sandbox.py"
    done = subprocess.run([sys.executable, str(bench), "--quick", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "start to ready" in done.stdout and "pasta" in done.stdout, done.stdout
