"""The per-replica sandbox: the OCI config as values (tables of named cases), and real runc containers
probed from inside (identity, files, environment, limits, devices, network, OOM, stop, adoption)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tensora.drivers import loopback
from tensora.sandbox import (
    SERVER_HOST,
    CgroupVersion,
    Device,
    HostFacts,
    Limits,
    Mount,
    Runc,
    SandboxError,
    SandboxSpec,
    SandboxState,
    available,
    oci_config,
)
from tensora.sandbox.host import cgroup_version, detect_host, missing_controllers
from tensora.sandbox.network import NetworkPlan, helper_pid, pasta_argv
from tensora.sandbox.seccomp import CLONE_NAMESPACE_FLAGS, DENIED

UID, GID = 12345, 12346
HOME = "/home/owner"
V1 = HostFacts(cgroup=CgroupVersion.V1, arch="x86_64",
               system_dirs=(("/usr", "/usr"), ("/bin", "/usr/bin"), ("/lib", "/usr/lib"), ("/etc", "/etc")))
V2 = replace(V1, cgroup=CgroupVersion.V2)
RO = ["bind", "ro", "nosuid", "nodev"]


def spec(**overrides: Any) -> SandboxSpec:
    """A sandbox spec builder: a notebook-like workload with a home, on a 1-vCPU 1 GiB class."""
    base = SandboxSpec(
        id="r-1", argv=("/usr/bin/python3", "-c", "pass"), uid=UID, gid=GID,
        limits=Limits(cpus=1.0, memory_bytes=1 << 30, pids=256),
        env={"PATH": "/usr/bin:/bin", "HOME": HOME}, cwd=HOME,
        mounts=(Mount("/srv/tensora/homes/o1/w1", HOME, writable=True), Mount("/srv/models/tiny", "/model")),
    )
    return replace(base, **overrides)


# -- oci_config: what the sandbox is granted ------------------------------------------------------------------


def _binds(config: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    return {m["destination"]: (m["source"], m["options"]) for m in config["mounts"] if m["type"] == "bind"}


def _no_nvidia(config: dict[str, Any]) -> bool:
    return "nvidia" not in json.dumps(config) and all(
        r.get("major") in (1, 5, 136) or not r["allow"] for r in config["linux"]["resources"]["devices"])


@dataclass(frozen=True)
class ConfigCase:
    spec: SandboxSpec
    check: Callable[[dict[str, Any]], bool]
    host: HostFacts = V1


CONFIG_CASES = {
    "runs as the owner's uid and gid, no supplementary groups": ConfigCase(
        spec(), lambda c: c["process"]["user"] == {"uid": UID, "gid": GID, "additionalGids": []}),
    "no capability in any set, no new privileges": ConfigCase(
        spec(), lambda c: all(v == [] for v in c["process"]["capabilities"].values())
        and len(c["process"]["capabilities"]) == 5 and c["process"]["noNewPrivileges"] is True),
    "environment is exactly the spec's": ConfigCase(
        spec(env={"PATH": "/usr/bin", "TOKEN_FILE": "/home/owner/.token"}),
        lambda c: c["process"]["env"] == ["PATH=/usr/bin", "TOKEN_FILE=/home/owner/.token"]),
    "root is empty and read-only": ConfigCase(spec(), lambda c: c["root"] == {"path": "rootfs", "readonly": True}),
    "host dirs: only the system dirs read-only, then the spec's mounts": ConfigCase(
        spec(), lambda c: _binds(c) == {
            "/usr": ("/usr", RO), "/bin": ("/usr/bin", RO), "/lib": ("/usr/lib", RO), "/etc": ("/etc", RO),
            HOME: ("/srv/tensora/homes/o1/w1", ["bind", "rw", "nosuid", "nodev"]), "/model": ("/srv/models/tiny", RO)}),
    "/tmp is a private size-limited tmpfs": ConfigCase(
        spec(limits=Limits(cpus=1, memory_bytes=1 << 30, tmp_bytes=256 << 20)),
        lambda c: any(m["destination"] == "/tmp" and m["type"] == "tmpfs" and "size=268435456" in m["options"]
                      for m in c["mounts"])),
    "own pid, ipc, uts, mount, cgroup and network namespaces": ConfigCase(
        spec(), lambda c: sorted(n["type"] for n in c["linux"]["namespaces"])
        == ["cgroup", "ipc", "mount", "network", "pid", "uts"]
        and all("path" not in n for n in c["linux"]["namespaces"])),
    "memory limit = memory+swap limit (no swap)": ConfigCase(
        spec(limits=Limits(cpus=4, memory_bytes=16 << 30)),
        lambda c: c["linux"]["resources"]["memory"] == {"limit": 16 << 30, "swap": 16 << 30}),
    "no swap limit where the host cannot set one": ConfigCase(
        spec(), lambda c: c["linux"]["resources"]["memory"] == {"limit": 1 << 30}, replace(V1, swap_limit=False)),
    "cpu quota from vCPUs over a 100 ms period, no cpuset unless given": ConfigCase(
        spec(limits=Limits(cpus=1.5, memory_bytes=1 << 30)),
        lambda c: c["linux"]["resources"]["cpu"] == {"quota": 150000, "period": 100000}),
    "cpuset when the node pins cores": ConfigCase(
        spec(limits=Limits(cpus=2, memory_bytes=1 << 30, cpuset="2-3")),
        lambda c: c["linux"]["resources"]["cpu"] == {"quota": 200000, "period": 100000, "cpus": "2-3"}),
    "pids limit": ConfigCase(
        spec(limits=Limits(cpus=1, memory_bytes=1 << 30, pids=77)),
        lambda c: c["linux"]["resources"]["pids"] == {"limit": 77}),
    "cgroup v1: under /tensora/<id>": ConfigCase(spec(id="abc"), lambda c: c["linux"]["cgroupsPath"] == "/tensora/abc"),
    "cgroup v2: under /tensora/<id>, same limits": ConfigCase(
        spec(id="abc"), lambda c: c["linux"]["cgroupsPath"] == "/tensora/abc"
        and c["linux"]["resources"]["memory"] == {"limit": 1 << 30, "swap": 1 << 30}, V2),
    "CPU class: no GPU device node nor rule": ConfigCase(spec(), _no_nvidia),
    "GPU class: its device nodes and allow rules after deny-all": ConfigCase(
        spec(devices=(Device("/dev/nvidia1", 195, 1), Device("/dev/nvidiactl", 195, 255))),
        lambda c: [d["path"] for d in c["linux"]["devices"]] == ["/dev/nvidia1", "/dev/nvidiactl"]
        and c["linux"]["resources"]["devices"][0] == {"allow": False, "access": "rwm"}
        and {(r["major"], r["minor"]) for r in c["linux"]["resources"]["devices"][1:] if r["major"] == 195}
        == {(195, 1), (195, 255)}),
    "standard devices only: null zero full random urandom tty, ptmx and pts": ConfigCase(
        spec(), lambda c: {(r["major"], r.get("minor")) for r in c["linux"]["resources"]["devices"] if r["allow"]}
        == {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2), (136, None)}),
    "open files limited, and never above what the host allows": ConfigCase(
        spec(), lambda c: {"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096} in c["process"]["rlimits"],
        replace(V1, nofile_max=4096)),
    "seccomp x86_64: default allow, mount and unshare EPERM, clone checked per namespace flag": ConfigCase(
        spec(), lambda c: c["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"
        and c["linux"]["seccomp"]["architectures"][0] == "SCMP_ARCH_X86_64"
        and {"mount", "unshare", "setns", "bpf", "userfaultfd", "keyctl"}
        <= set(c["linux"]["seccomp"]["syscalls"][0]["names"])
        and sum(s["names"] == ["clone"] for s in c["linux"]["seccomp"]["syscalls"]) == len(CLONE_NAMESPACE_FLAGS)),
    "seccomp aarch64": ConfigCase(
        spec(), lambda c: c["linux"]["seccomp"]["architectures"] == ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
        replace(V1, arch="aarch64")),
    "masked /proc/kcore and /sys/firmware, read-only /proc/sys": ConfigCase(
        spec(), lambda c: {"/proc/kcore", "/sys/firmware"} <= set(c["linux"]["maskedPaths"])
        and "/proc/sys" in c["linux"]["readonlyPaths"]),
}


@pytest.mark.parametrize("case", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_oci_config(case: ConfigCase) -> None:
    config = oci_config(case.spec, case.host)
    assert case.check(config), json.dumps(config, indent=1)[:4000]


def test_oci_config_joins_the_network_namespace_it_is_given() -> None:
    config = oci_config(spec(), V1, netns="/b/r-1/netns")
    assert {"type": "network", "path": "/b/r-1/netns"} in config["linux"]["namespaces"]


REFUSED = {
    "uid 0": spec(uid=0),
    "gid 0": spec(gid=0),
    "empty argv": spec(argv=()),
    "id with a slash": spec(id="../x"),
    "id with a space": spec(id="a b"),
    "mount over /usr": spec(mounts=(Mount("/srv/x", "/usr"),)),
    "mount inside /etc": spec(mounts=(Mount("/srv/x", "/etc/ssl/private"),)),
    "mount over /": spec(mounts=(Mount("/srv/x", "/"),)),
    "mount inside /proc": spec(mounts=(Mount("/srv/x", "/proc/1"),)),
    "relative target": spec(mounts=(Mount("/srv/x", "home"),)),
    "target climbing with ..": spec(mounts=(Mount("/srv/x", "/home/../usr/x"),)),
    "relative source": spec(mounts=(Mount("srv/x", "/data"),)),
    "a target twice": spec(mounts=(Mount("/srv/x", "/data"), Mount("/srv/y", "/data"))),
    "device outside /dev": spec(devices=(Device("/tmp/nvidia0", 195, 0),)),
    "block device": spec(devices=(Device("/dev/vda", 254, 0, type="b"),)),
    "variable name with =": spec(env={"A=B": "1"}),
    "zero cpus": spec(limits=Limits(cpus=0, memory_bytes=1 << 30)),
    "tiny memory": spec(limits=Limits(cpus=1, memory_bytes=1024)),
    "bad cpuset": spec(limits=Limits(cpus=1, memory_bytes=1 << 30, cpuset="0-3; rm")),
    "port 0": spec(publish=((0, 8080),)),
    "a host port twice": spec(publish=((18000, 8080), (18000, 8081))),
    "a port both published and forwarded": spec(publish=((18000, 8700),), allow_host_ports=((8700, 8720),)),
    "a sandbox port forwarded twice": spec(allow_host_ports=((8700, 8720), (8700, 8721))),
    "a forward to host port 0": spec(allow_host_ports=((8700, 0),)),
    "published on every address": spec(publish=((18000, 8080),), publish_address="0.0.0.0"),
    "published on a non-loopback address": spec(publish=((18000, 8080),), publish_address="10.0.0.1"),
    "published on a name": spec(publish=((18000, 8080),), publish_address="localhost"),
}


@pytest.mark.parametrize("bad", REFUSED.values(), ids=REFUSED.keys())
def test_oci_config_refuses(bad: SandboxSpec) -> None:
    with pytest.raises(ValueError):
        oci_config(bad, V1)


def test_oci_config_refuses_an_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="seccomp"):
        oci_config(spec(), replace(V1, arch="riscv64"))


def test_seccomp_denies_what_docker_denies_without_capabilities() -> None:
    assert {"mount", "umount2", "pivot_root", "swapon", "swapoff", "reboot", "kexec_load", "init_module",
            "finit_module", "delete_module", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
            "userfaultfd", "open_by_handle_at", "setns", "unshare", "acct", "iopl", "ioperm", "quotactl",
            "lookup_dcookie", "name_to_handle_at"} <= set(DENIED)


# -- pasta's command line ----------------------------------------------------------------------------------------

PASTA_CASES = {
    "no publish, no allow: nothing forwarded either way": (
        NetworkPlan(Path("/b/x")), ["-t", "none", "-u", "none", "-U", "none", "-T", "none"]),
    "publish on the host's loopback only": (
        NetworkPlan(Path("/b/x"), publish=((18080, 8080),)), ["-t", "127.0.0.1/18080:8080"]),
    "publish on the replica's own loopback address": (
        NetworkPlan(Path("/b/x"), publish=((18080, 8080),), publish_address="127.4.5.6"),
        ["-t", "127.4.5.6/18080:8080"]),
    "allowed host ports forwarded from the namespace's loopback": (
        NetworkPlan(Path("/b/x"), allow_host_ports=((8700, 8700), (8701, 8701))), ["-T", "8700,8701"]),
    "a namespace port forwarded to another host port (the servers' sandbox listeners)": (
        NetworkPlan(Path("/b/x"), allow_host_ports=((8700, 8720), (8701, 8721))), ["-T", "8700:8720,8701:8721"]),
    "the same and mapped forwards together": (
        NetworkPlan(Path("/b/x"), allow_host_ports=((8700, 8720), (9000, 9000))), ["-T", "8700:8720,9000"]),
    "the gateway is not mapped to the host": (NetworkPlan(Path("/b/x")), ["--no-map-gw"]),
    "IPv4 only unless asked": (NetworkPlan(Path("/b/x")), ["-4"]),
    "no ICMP (nothing in the sandbox may open ping sockets)": (NetworkPlan(Path("/b/x")), ["--no-icmp"]),
    "joins the bundle's namespace file": (NetworkPlan(Path("/b/x")), ["--netns", "/b/x/netns"]),
}


@pytest.mark.parametrize("case", PASTA_CASES.values(), ids=PASTA_CASES.keys())
def test_pasta_argv(case: tuple[NetworkPlan, list[str]]) -> None:
    plan, want = case
    argv = pasta_argv(plan)
    assert any(argv[i:i + len(want)] == want for i in range(len(argv))), argv
    assert "auto" not in argv


def test_pasta_argv_ipv6_when_asked() -> None:
    assert "-4" not in pasta_argv(NetworkPlan(Path("/b/x"), ipv6=True))


# -- the host -----------------------------------------------------------------------------------------------------


def test_detect_host_binds_merged_usr_links_from_their_targets(tmp_path: Path) -> None:
    for d in ("usr/bin", "usr/lib", "etc"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib").symlink_to("usr/lib")
    facts = detect_host(tmp_path / "cgroup", fs_root=tmp_path)
    assert facts.system_dirs == (("/usr", "/usr"), ("/bin", "/usr/bin"), ("/lib", "/usr/lib"), ("/etc", "/etc"))


def test_cgroup_version_and_controllers(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    for c in ("memory", "cpu", "pids"):
        (v1 / c).mkdir(parents=True)
        (v1 / c / "cgroup.procs").touch()
    (v1 / "unified").mkdir()  # a hybrid host's empty cgroup2
    assert cgroup_version(v1) is CgroupVersion.V1
    assert missing_controllers(CgroupVersion.V1, v1) == ["devices"]
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    assert cgroup_version(v2) is CgroupVersion.V2
    assert missing_controllers(CgroupVersion.V2, v2) == ["pids"]


# -- real runc ----------------------------------------------------------------------------------------------------

WHY_NOT = available()
real = pytest.mark.skipif(WHY_NOT is not None, reason=f"no sandbox on this host: {WHY_NOT}")
PY = "/usr/bin/python3"  # Debian's: under /usr, so visible in every sandbox
RUN = secrets.token_hex(3)  # cgroups are host-wide (/tensora/<id>): ids unique to this run


def sid(name: str) -> str:
    return f"{name}-{RUN}"

PROBE = r"""
import ctypes, errno, json, os, platform, socket, subprocess
out = {}
out["uid"], out["gid"], out["groups"] = os.getuid(), os.getgid(), os.getgroups()
out["environ"] = dict(kv.split("=", 1) for kv in open("/proc/self/environ").read().split("\0") if kv)
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
keys = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
out["status"] = {k: status[k].strip() for k in keys}
out["root_entries"] = sorted(os.listdir("/"))
out["dev"] = sorted(os.listdir("/dev"))
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
out["read_data"] = attempt(lambda: open(os.environ["DATA_KEY"]).read())
out["list_data"] = attempt(lambda: os.listdir(os.path.dirname(os.environ["DATA_KEY"])))
out["read_root"] = attempt(lambda: os.listdir("/root"))
out["read_host_tmp"] = attempt(lambda: open(os.environ["HOST_TMP_FILE"]).read())
out["write_root"] = attempt(lambda: open("/evil", "w").write("x"))
out["write_usr"] = attempt(lambda: open("/usr/evil", "w").write("x"))
out["write_etc"] = attempt(lambda: open("/etc/evil", "w").write("x"))
out["write_home"] = attempt(lambda: open(os.environ["HOME"] + "/note", "w").write("x"))
out["write_tmp"] = attempt(lambda: open("/tmp/note", "w").write("x"))
v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
if v2:
    out["memory_limit"] = int(open("/sys/fs/cgroup/memory.max").read())
    quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
    out["cpu"] = [int(quota), int(period)]
    out["pids"] = int(open("/sys/fs/cgroup/pids.max").read())
else:
    out["memory_limit"] = int(open("/sys/fs/cgroup/memory/memory.limit_in_bytes").read())
    out["cpu"] = [int(open("/sys/fs/cgroup/cpu/cpu.cfs_" + f).read()) for f in ("quota_us", "period_us")]
    out["pids"] = int(open("/sys/fs/cgroup/pids/pids.max").read())
out["unshare_user"] = subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 56, "aarch64": 220}[platform.machine()]
pid = libc.syscall(nr, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
if pid == 0:
    os._exit(0)
out["clone_newuser"] = errno.errorcode.get(ctypes.get_errno(), "ok") if pid < 0 else "ok"
if pid > 0:
    os.waitpid(pid, 0)
def vsock():
    socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK: a guest's path to its host
out["vsock"] = attempt(vsock)
out["routes"] = [l.split()[:2] for l in open("/proc/net/route").read().splitlines()[1:]]
json.dump(out, open(os.environ["HOME"] + "/probe.json", "w"))
"""


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runc]:
    r = Runc(tmp_path / "runc-root", tmp_path / "bundles")
    yield r
    for sandbox_id in r.list():
        r.delete(sandbox_id)


def home_dir(tmp_path: Path, name: str = "home") -> Path:
    home = tmp_path / name
    home.mkdir()
    os.chown(home, UID, GID)
    return home


def sandbox(sandbox_id: str, code: str, home: Path, **overrides: Any) -> SandboxSpec:
    base = SandboxSpec(
        id=sandbox_id, argv=(PY, "-c", code), uid=UID, gid=GID,
        limits=Limits(cpus=0.5, memory_bytes=256 << 20, pids=64),
        env={"PATH": "/usr/bin:/bin", "HOME": HOME, "LANG": "C.UTF-8"}, cwd=HOME,
        mounts=(Mount(str(home), HOME, writable=True),))
    return replace(base, **overrides)


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def probed(runner: Runc, tmp_path: Path) -> tuple[dict[str, Any], dict[str, str], Runc]:
    """One sandbox that probes itself and exits; its report."""
    data = tmp_path / "data"  # a stand-in for Tensora's DATA_DIR, world-readable on purpose:
    data.mkdir()              # only the mount namespace may keep it out
    (data / "admin-key").write_text("tsk-admin-secret")
    for p in (tmp_path, data, data / "admin-key"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    host_tmp = Path("/tmp") / f"tensora-sandbox-test-{os.getpid()}"
    host_tmp.write_text("host tmp")
    home = home_dir(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "HOME": HOME, "LANG": "C.UTF-8", "DATA_KEY": str(data / "admin-key"),
           "HOST_TMP_FILE": str(host_tmp)}
    s = sandbox(sid("probe"), PROBE, home, env=env, limits=Limits(cpus=0.5, memory_bytes=192 << 20, pids=64))
    try:
        runner.start(s)
        wait_until(lambda: runner.state(sid("probe")) is SandboxState.STOPPED)
    finally:
        host_tmp.unlink()
    report = home / "probe.json"
    assert report.exists(), (runner.bundle(sid("probe")) / "out.log").read_text()
    return json.loads(report.read_text()), env, runner


@pytest.mark.slow
@real
def test_sandbox_identity_and_privileges(probed: tuple[dict[str, Any], dict[str, str], Runc]) -> None:
    report, _, _ = probed
    assert (report["uid"], report["gid"], report["groups"]) == (UID, GID, [])
    status = report["status"]
    assert {status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {"0000000000000000"}
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")
    assert report["unshare_user"] != 0
    assert report["clone_newuser"] == "EPERM"


@pytest.mark.slow
@real
def test_sandbox_cannot_open_a_vsock(probed: tuple[dict[str, Any], dict[str, str], Runc]) -> None:
    """AF_VSOCK reaches the hypervisor's host side (and, nested, its other guests): refused as Docker's default
    profile refuses it."""
    report, _, _ = probed
    assert report["vsock"] in ("EPERM", "EAFNOSUPPORT")


@pytest.mark.slow
@real
def test_sandbox_environment_is_only_what_was_given(probed: tuple[dict[str, Any], dict[str, str], Runc]) -> None:
    report, env, _ = probed
    assert report["environ"] == env


@pytest.mark.slow
@real
def test_sandbox_filesystem(probed: tuple[dict[str, Any], dict[str, str], Runc]) -> None:
    report, _, _ = probed
    assert report["read_data"] == "ENOENT" and report["list_data"] == "ENOENT"
    assert report["read_root"] == "ENOENT" and report["read_host_tmp"] == "ENOENT"
    assert "root" not in report["root_entries"] and "work" not in report["root_entries"]
    assert {report["write_root"], report["write_usr"], report["write_etc"]} == {"EROFS"}
    assert (report["write_home"], report["write_tmp"]) == ("ok", "ok")


@pytest.mark.slow
@real
def test_sandbox_limits_read_back_inside(probed: tuple[dict[str, Any], dict[str, str], Runc]) -> None:
    report, _, _ = probed
    assert report["memory_limit"] == 192 << 20
    assert report["cpu"] == [50000, 100000]
    assert report["pids"] == 64


@pytest.mark.slow
@real
def test_sandbox_devices_and_route(probed: tuple[dict[str, Any], dict[str, str], Runc]) -> None:
    report, _, runner = probed
    character = {"full", "null", "random", "tty", "urandom", "zero", "ptmx"}
    links_and_dirs = {"fd", "stdin", "stdout", "stderr", "pts", "shm", "mqueue", "console"}
    assert set(report["dev"]) - links_and_dirs == character
    assert ["eth0", "00000000"] in report["routes"]  # a default route: egress possible
    assert runner.exit_reason(sid("probe")) is None and not runner.oom_killed(sid("probe"))


@pytest.mark.slow
@real
def test_gpu_class_sees_its_device_nodes(runner: Runc, tmp_path: Path) -> None:
    # no GPU here: /dev/nvidia0 is given the numbers of /dev/null, which shows the node is created and allowed
    home = home_dir(tmp_path)
    code = ("import os; open('/dev/nvidia0', 'w').write('x')\n"
            "open(os.environ['HOME'] + '/dev', 'w').write(' '.join(sorted(os.listdir('/dev'))))")
    runner.start(sandbox(sid("gpu"), code, home, devices=(Device("/dev/nvidia0", 1, 3),)))
    wait_until(lambda: runner.state(sid("gpu")) is SandboxState.STOPPED)
    assert "nvidia0" in (home / "dev").read_text().split(), (runner.bundle(sid("gpu")) / "out.log").read_text()


@pytest.mark.slow
@real
def test_out_of_memory_is_the_exit_reason(runner: Runc, tmp_path: Path) -> None:
    home = home_dir(tmp_path)
    hog = "x = bytearray(400 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1"
    runner.start(sandbox(sid("hog"), hog, home, limits=Limits(cpus=1, memory_bytes=64 << 20, pids=64)))
    wait_until(lambda: runner.state(sid("hog")) is SandboxState.STOPPED)
    assert runner.oom_killed(sid("hog"))
    assert runner.exit_reason(sid("hog")) == "out of memory: limit 64Mi"


def _tcp_server(reply: bytes) -> tuple[int, Callable[[], None]]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join()
        srv.close()

    return int(srv.getsockname()[1]), close


NET_PROBE = r"""
import json, os, socket
def reach(host, port, timeout):
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(3)
            return s.recv(64).decode() or "connected"
    except OSError as e:
        return type(e).__name__
gateway = next(socket.inet_ntoa(bytes.fromhex(l.split()[2])[::-1])
               for l in open("/proc/net/route").read().splitlines()[1:] if l.split()[1] == "00000000")
ports = json.loads(os.environ["PORTS"])
# the gateway is a real router here: it may drop rather than refuse, hence the short wait
out = {name: {"loopback": reach("127.0.0.1", p, 3), "gateway": reach(gateway, p, 1)} for name, p in ports.items()}
out["at its address"] = {host: reach(host, p, 3) for host, p in json.loads(os.environ.get("AT", "{}")).items()}
json.dump(out, open(os.environ["HOME"] + "/net.json", "w"))
"""

SERVER = r"""
import http.server, os, sys
os.chdir(os.environ["HOME"])
open("index.html", "w").write("hello from the sandbox")
http.server.ThreadingHTTPServer((sys.argv[1], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


@pytest.mark.slow
@real
def test_network_publishes_the_server_and_reaches_only_allowed_host_ports(runner: Runc, tmp_path: Path) -> None:
    private, close_private = _tcp_server(b"private")   # a database or Redis on the host's loopback
    allowed, close_allowed = _tcp_server(b"tensora-api")  # Tensora's API, which checks keys
    try:
        # another replica's model server, published on the host at a loopback address of its own
        address = loopback.candidate(sid("server"), 0)
        published = loopback.free_port(address)
        server = sandbox(sid("server"), SERVER, home_dir(tmp_path, "server-home"), publish=((published, 8080),))
        server = replace(server, argv=(*server.argv, SERVER_HOST), publish_address=address)
        runner.start(server)

        def answers(host: str) -> bool:
            try:
                return urllib.request.urlopen(f"http://{host}:{published}/index.html", timeout=2).read() \
                    == b"hello from the sandbox"
            except OSError:
                return False

        wait_until(lambda: answers(address))
        assert not answers("127.0.0.1")  # not on Tensora's own address
        # a notebook that tries them all
        home = home_dir(tmp_path, "probe-home")
        # Tensora's URL inside (its port) reaches the host's sandbox listener, another port (tensora.listeners)
        inside = free_port()
        ports = {"private": private, "allowed": inside, "the listener's own port": allowed, "other replica": published}
        probe = sandbox(sid("netprobe"), NET_PROBE, home, allow_host_ports=((inside, allowed),))
        runner.start(replace(probe, env={**probe.env, "PORTS": json.dumps(ports),
                                         "AT": json.dumps({address: published})}))
        wait_until(lambda: runner.state(sid("netprobe")) is SandboxState.STOPPED)
        net = json.loads((home / "net.json").read_text())
    finally:
        close_private()
        close_allowed()
    assert net["allowed"]["loopback"] == "tensora-api"
    assert net["private"]["loopback"] == "ConnectionRefusedError"
    assert net["the listener's own port"]["loopback"] == "ConnectionRefusedError"  # only the forward, as mapped
    assert net["other replica"]["loopback"] == "ConnectionRefusedError"
    assert net["at its address"] == {address: "ConnectionRefusedError"}  # the sandbox's own loopback there
    # the gateway is not the host (pasta would map it to the host's loopback without --no-map-gw)
    for name in ("private", "allowed", "other replica"):
        assert net[name]["gateway"] not in ("private", "tensora-api", "connected"), net


@pytest.mark.slow
@real
@pytest.mark.timeout(120)
def test_stop_sends_sigterm_first(runner: Runc, tmp_path: Path) -> None:
    home = home_dir(tmp_path)
    code = ("import os, signal, sys, time\n"
            "def term(*_):\n"
            "    open(os.environ['HOME'] + '/signal', 'w').write('TERM'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "open(os.environ['HOME'] + '/ready', 'w').write('1')\n"
            "while True: time.sleep(1)\n")
    runner.start(sandbox(sid("graceful"), code, home))
    wait_until(lambda: (home / "ready").exists())
    assert runner.stop(sid("graceful"), grace_s=20) is True  # it ended on the SIGTERM, within the grace: no SIGKILL
    assert (home / "signal").read_text() == "TERM"
    assert runner.state(sid("graceful")) is SandboxState.STOPPED


@pytest.mark.slow
@real
def test_stop_kills_what_ignores_sigterm(runner: Runc, tmp_path: Path) -> None:
    home = home_dir(tmp_path)
    code = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "open(os.environ['HOME'] + '/ready', 'w').write('1')\nwhile True: time.sleep(1)\n")
    runner.start(sandbox(sid("stubborn"), code, home))
    wait_until(lambda: (home / "ready").exists())
    assert runner.stop(sid("stubborn"), grace_s=1) is False
    assert runner.state(sid("stubborn")) is SandboxState.STOPPED


@pytest.mark.slow
@real
def test_a_new_runner_on_the_same_root_adopts_and_deletes(runner: Runc, tmp_path: Path) -> None:
    home = home_dir(tmp_path)
    first = runner.start(sandbox(sid("kept"), "import time; time.sleep(600)", home, publish=((free_port(), 8080),)))
    assert first.net_pid is not None
    # Tensora restarts: a new object, same runtime root and bundles
    again = Runc(runner.root, runner.bundles)
    assert again.list() == [sid("kept")]
    assert again.state(sid("kept")) is SandboxState.RUNNING
    assert again.handle(sid("kept")) == first
    cgroup = Path("/sys/fs/cgroup/memory/tensora") / sid("kept") if again.host.cgroup is CgroupVersion.V1 \
        else Path("/sys/fs/cgroup/tensora") / sid("kept")
    assert cgroup.is_dir()
    again.delete(sid("kept"))
    assert again.list() == [] and runner.list() == []
    assert not runner.bundle(sid("kept")).exists() and not cgroup.exists()
    wait_until(lambda: not _alive(first.pid) and not _alive(first.net_pid or 0), timeout=10)
    again.delete(sid("kept"))  # idempotent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@real
def test_a_failed_start_leaves_nothing(runner: Runc, tmp_path: Path) -> None:
    home = home_dir(tmp_path)
    bad = replace(sandbox(sid("broken"), "", home), argv=("/usr/bin/no-such-program",))
    with pytest.raises(SandboxError, match="no-such-program"):
        runner.start(bad)
    assert runner.list() == [] and not runner.bundle(sid("broken")).exists()
    assert helper_pid(runner.bundle(sid("broken"))) is None


@pytest.mark.slow
@real
def test_an_id_in_use_is_refused(runner: Runc, tmp_path: Path) -> None:
    home = home_dir(tmp_path)
    runner.start(sandbox(sid("twice"), "import time; time.sleep(600)", home))
    with pytest.raises(SandboxError, match="exists"):
        runner.start(sandbox(sid("twice"), "pass", home))
    assert runner.state(sid("twice")) is SandboxState.RUNNING



@pytest.mark.slow
@real
def test_a_taken_host_port_fails_the_start_and_leaves_nothing(runner: Runc, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with pytest.raises(SandboxError, match=f"{port}"):
            runner.start(sandbox(sid("collide"), "pass", home_dir(tmp_path), publish=((port, 8080),)))
    assert runner.list() == [] and not runner.bundle(sid("collide")).exists()


def test_crun_is_refused_on_cgroup_v1(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cgroup v2"):
        Runc(tmp_path / "root", tmp_path / "bundles", runtime="crun", host=V1)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no sandbox on this host: {WHY_NOT}")
def test_available_names_missing_cgroup_controllers(tmp_path: Path) -> None:
    for c in ("memory", "cpu", "pids"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "cgroup.procs").touch()
    assert available(root=tmp_path) == "no usable cgroup v1 controllers: devices missing"
