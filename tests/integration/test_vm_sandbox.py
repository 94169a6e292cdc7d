"""A VM's disk in the local driver (``drivers.vmdisk`` wired into ``drivers.local``): images uploaded as owners
upload them boot under a copy-on-write overlay of their own, as the owner's uid, with every format named; the
owner's image stays byte-identical whatever the guest writes; an image whose backing chain leaves the owner's
files fails the replica before QEMU starts.

The admin key here is a FIFO: opening it for reading blocks until a writer comes, so anything that opened it
(Python, qemu-img, QEMU) would hang the test, and a refusal that comes back at once shows it was not opened
(``test_vmdisk.test_the_fifo_would_catch_an_open`` is the control)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers import launch as plan
from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.drivers.local import Isolation, LocalDriver
from tensora.drivers.qmp import qmp
from tensora.placement.capacity import Node
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.sandbox import available
from tensora.storage import owner_dir
from tests.support.services import sweep

WHY_NOT = available() or (None if shutil.which("qemu-system-x86_64") and shutil.which("qemu-img")
                          else "QEMU is not installed (apt-get install qemu-system-x86 qemu-utils)")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"cannot run VMs here: {WHY_NOT}")]

CATALOG = default_catalog()
NODE = Node("box", "local", 4, 16 * 2**30)
RUN = secrets.token_hex(3)  # sandboxes' cgroups are host-wide (/tensora/<id>): replica ids unique to this run
UID = 160_000 + int(RUN, 16) % 5000
MIB = 2**20
DEVICE = "/machine/peripheral/disk0-dev/virtio-backend"
"""The VM's disk as qemu-io inside QEMU names it (``vmdisk.qemu_disk_args`` gives the device ``disk0-dev``)."""


class Box:
    """A data dir as ``tensora up`` keeps it: the admin key (a FIFO here), owners' files as ``tensora.storage``
    lays them out (a 0700 dir per owner, uploads 0644), an operator's shared root, and a driver over it."""

    def __init__(self, tmp: Path, isolation: Isolation = Isolation.SANDBOX) -> None:
        self.tmp = tmp
        self.data = tmp / "data"
        self.data.mkdir()
        self.admin_key = self.data / "admin-key"
        os.mkfifo(self.admin_key, 0o600)
        self.pool = tmp / "pool"
        self.pool.mkdir()
        self.driver = LocalDriver(self.data, NODE, CATALOG, isolation=isolation, shared_models={"pool": self.pool})

    def files(self, owner: str = "alice") -> Path:
        where = owner_dir(self.data / "files", owner)
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        return where

    def raw(self, name: str, owner: str = "alice", fill: bytes = b"\x5a") -> Path:
        path = self.files(owner) / name
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)  # as an upload makes its dirs
        path.write_bytes(fill * MIB)
        path.chmod(0o644)
        return path

    def qcow2(self, name: str, backing: Path | None = None, fmt: str = "raw", where: Path | None = None,
              size: str = str(MIB)) -> Path:
        """A qcow2 in alice's files (or ``where``); ``backing`` written as given (``-u``: nothing opens it)."""
        path = (where or self.files()) / name
        back = ["-b", str(backing), "-F", fmt, "-u"] if backing is not None else []
        qemu_img("create", "-q", "-f", "qcow2", *back, str(path), size)
        path.chmod(0o644)
        return path

    def start(self, name: str, image: Path | None, workload: str = "wl_disk") -> ReplicaStatus:
        return self.driver.start(spec(name, image, workload))

    def overlay(self, name: str) -> Path:
        return self.driver.root / rid(name) / "vm" / plan.DISK


def rid(name: str) -> str:
    return f"rp_{name}_{RUN}"


def spec(name: str, image: Path | None, workload: str = "wl_disk") -> ReplicaSpec:
    return ReplicaSpec(rid(name), workload, WorkloadKind.VM, "cpu-1c-4g", "box", image=str(image) if image else None,
                       owner="alice", uid=UID, gid=UID)


def qemu_img(*args: str) -> str:
    return subprocess.run(["qemu-img", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hashes(*dirs: Path) -> dict[Path, str]:
    """Every regular file under the dirs (owners' files, shared roots), by content."""
    return {p: sha256(p) for d in dirs for p in sorted(d.rglob("*")) if p.is_file() and not p.is_symlink()}


def nobody_reads(fifo: Path) -> bool:
    """True when no process has the FIFO open for reading now (opening it to write would fail)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        return e.errno == errno.ENXIO
    os.close(fd)
    return False


def qemu_processes(replica_id: str) -> list[int]:
    """Pids of QEMUs started for the replica (QEMU's ``-name tensora-<id>``), wherever they run."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"-name" in argv and f"tensora-{replica_id}".encode() in argv:
                found.append(int(entry.name))
    return found


def wait_for(driver: LocalDriver, replica_id: str, states: set[ReplicaState], deadline_s: float = 30) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        seen = {s.id: s for s in driver.observe()}.get(replica_id)
        if seen is not None and seen.state in states:
            return seen
        assert time.monotonic() < deadline, f"{replica_id} not {states} in {deadline_s}s: {seen}"
        time.sleep(0.1)


def running(box: Box, name: str) -> dict[str, Any]:
    status = wait_for(box.driver, rid(name), {ReplicaState.RUNNING, ReplicaState.FAILED})
    assert status.state is ReplicaState.RUNNING, status.detail
    m = box.driver._read(rid(name))
    assert m is not None
    return m


def stop(box: Box, name: str) -> None:
    """The driver's stop, then QMP quit at once (no OS answers the powerdown; the driver would wait for it)."""
    m = box.driver._read(rid(name))
    assert m is not None
    box.driver.stop(rid(name))
    with contextlib.suppress(OSError):  # QEMU may close the socket before it answers
        qmp(m["socket"], {"execute": "quit"})
    assert wait_for(box.driver, rid(name), {ReplicaState.STOPPED, ReplicaState.FAILED}).state is ReplicaState.STOPPED


def guest_write(socket: str, pattern: int) -> None:
    """Write 4 KiB at offset 0 of the VM's disk from inside the running QEMU, as the guest's driver would."""
    said = qmp(socket, {"execute": "human-monitor-command",
                        "arguments": {"command-line": f'qemu-io -d {DEVICE} "write -P {pattern:#x} 0 4k"'}})[0]
    assert "rror" not in said, said


def overlay_holds(overlay: Path, pattern: int) -> bool:
    """Whether the overlay itself (its backing left out: nothing opens the base) holds ``pattern`` at 0."""
    io = subprocess.run(["qemu-io", "--image-opts", "-c", f"read -P {pattern:#x} 0 4k",
                         f"driver=qcow2,file.driver=file,file.filename={overlay},backing="],
                        capture_output=True, text=True, timeout=30)
    return io.returncode == 0 and "read 4096/4096" in io.stdout and "Pattern verification failed" not in io.stdout


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    b = Box(tmp_path)
    yield b
    sweep(b.data)  # leave no process behind, whatever the test did


# -- images owners upload boot under an overlay of their own ----------------------------------------------------


@dataclass(frozen=True)
class Boot:
    build: Callable[[Box], Path]
    formats: tuple[str, ...]
    """The disk's chain as QEMU shows it: the overlay first."""


BOOTS = {
    "a raw image -> the overlay over it": Boot(lambda b: b.raw("disk.raw"), ("qcow2", "raw")),
    "a qcow2 image -> the overlay over it": Boot(lambda b: b.qcow2("disk.qcow2"), ("qcow2", "qcow2")),
    "a qcow2 over a raw base, both the owner's -> the overlay over both": Boot(
        lambda b: b.qcow2("disk.qcow2", b.raw("images/base.raw")), ("qcow2", "qcow2", "raw")),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", BOOTS.values(), ids=BOOTS.keys())
def test_an_uploaded_image_boots_under_its_own_overlay_as_the_owner_and_stays_intact(box: Box, case: Boot) -> None:
    image = case.build(box)
    before = hashes(box.files(), box.pool)
    box.start("boot", image)
    m = running(box, "boot")
    # 1. QEMU as the owner's uid, the disk as -blockdev nodes, QEMU's own seccomp on
    assert Path(f"/proc/{m['pid']}").stat().st_uid == UID
    argv = Path(f"/proc/{m['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"-blockdev" in argv and b"-drive" not in argv and not [a for a in argv if b"snapshot" in a]
    assert argv[argv.index(b"-sandbox") + 1].startswith(b"on,")
    # 2. the overlay: in the replica's VM dir, the owner's, 0600
    overlay = box.overlay("boot")
    st = overlay.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, UID, 0o600)
    # 3. QEMU's view: the overlay (writable) over the owner's chain (read-only), each format as given
    [disk] = [b for b in qmp(m["socket"], {"execute": "query-block"})[0] if b.get("inserted")]
    inserted = disk["inserted"]
    assert (inserted["node-name"], inserted["drv"], inserted["ro"]) == ("disk0", "qcow2", False)
    chain, image_info = [], inserted["image"]
    while image_info is not None:
        chain.append(image_info["format"])
        image_info = image_info.get("backing-image")
    assert chain == list(case.formats)
    nodes = {n["node-name"]: n for n in qmp(m["socket"], {"execute": "query-named-block-nodes"})[0]}
    bases = [f"disk0-base{i}" for i in range(1, len(case.formats))]
    assert [nodes[n]["drv"] for n in ("disk0", *bases)] == list(case.formats)
    assert [nodes[f"{n}-file"]["file"] for n in ("disk0", *bases)] == [
        "/vm/disk.qcow2", *(f"/image/{i}" for i in range(len(bases)))]
    assert not nodes["disk0"]["ro"] and all(nodes[n]["ro"] and nodes[f"{n}-file"]["ro"] for n in bases)
    # 4. the guest writes: into the overlay only
    guest_write(m["socket"], 0xCD)
    stop(box, "boot")
    assert hashes(box.files(), box.pool) == before
    assert overlay_holds(overlay, 0xCD)
    assert nobody_reads(box.admin_key)


@pytest.mark.timeout(120)
def test_the_overlay_is_kept_for_the_same_replica_new_for_a_new_one_and_released_with_the_workload(box: Box) -> None:
    image = box.raw("disk.raw")
    before = sha256(image)
    box.start("one", image)
    guest_write(running(box, "one")["socket"], 0xAB)
    stop(box, "one")
    first = box.overlay("one").stat()
    # the same replica started again (a retried start): the same disk, with what its guest wrote
    box.start("one", image)
    running(box, "one")
    stop(box, "one")
    assert (box.overlay("one").stat().st_ino, box.overlay("one").stat().st_dev) == (first.st_ino, first.st_dev)
    assert overlay_holds(box.overlay("one"), 0xAB)
    # a new replica of the workload: a fresh overlay over the owner's image as it is
    box.start("two", image)
    running(box, "two")
    stop(box, "two")
    assert not overlay_holds(box.overlay("two"), 0xAB) and overlay_holds(box.overlay("two"), 0x00)
    assert sha256(image) == before
    box.driver.release("wl_disk")  # the workload deleted: what its guests wrote goes
    assert not box.overlay("one").exists() and not box.overlay("two").exists()
    assert sha256(image) == before


@pytest.mark.timeout(120)
def test_an_image_in_a_shared_root_boots_with_its_chain_inside_that_root(box: Box) -> None:
    (box.pool / "os").mkdir()
    base = box.qcow2("os/base.qcow2", where=box.pool)
    image = box.qcow2("os/top.qcow2", base, "qcow2", where=box.pool)
    before = hashes(box.pool)
    box.start("shared", image)
    m = running(box, "shared")
    nodes = {n["node-name"]: n for n in qmp(m["socket"], {"execute": "query-named-block-nodes"})[0]}
    assert [nodes[n]["file"] for n in ("disk0-base1-file", "disk0-base2-file")] == ["/image/0", "/image/1"]
    guest_write(m["socket"], 0xEE)
    stop(box, "shared")
    assert hashes(box.pool) == before


@pytest.mark.timeout(120)
def test_unsandboxed_qemu_gets_the_same_checked_disk_at_host_paths(tmp_path: Path) -> None:
    box = Box(tmp_path, Isolation.NONE)
    try:
        image = box.raw("disk.raw")
        before = sha256(image)
        box.start("plain", image)
        m = running(box, "plain")
        nodes = {n["node-name"]: n for n in qmp(m["socket"], {"execute": "query-named-block-nodes"})[0]}
        assert (nodes["disk0-file"]["file"], nodes["disk0-base1-file"]["file"]) == (str(box.overlay("plain")),
                                                                                   str(image))
        guest_write(m["socket"], 0x11)
        stop(box, "plain")
        assert sha256(image) == before and overlay_holds(box.overlay("plain"), 0x11)
    finally:
        sweep(box.data)


# -- images that leave the owner's files fail the replica before QEMU starts --------------------------------------


def with_data_file(box: Box, name: str, data_file: Path) -> Path:
    """A qcow2 whose external data file is ``data_file``, made a FIFO afterwards so that opening it would hang."""
    path = box.files() / name
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={data_file}", str(path), str(MIB))
    data_file.unlink()
    os.mkfifo(data_file)
    path.chmod(0o644)
    return path


def vmdk_descriptor(box: Box, name: str, extent: Path) -> Path:
    path = box.files() / name
    path.write_text('# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n'
                    f'createType="monolithicFlat"\nRW 2048 FLAT "{extent}" 0\n')
    path.chmod(0o644)
    return path


def unreadable(path: Path) -> Path:
    path.chmod(0o600)
    return path


REFUSED: dict[str, tuple[Callable[[Box], Path], str]] = {
    "the attack: backing file DATA_DIR/admin-key -> refused, the key never opened": (
        lambda b: b.qcow2("evil.qcow2", b.admin_key), "evil.qcow2: its backing file is not in your files"),
    "a relative backing name climbing to the admin key -> refused": (
        lambda b: b.qcow2("evil.qcow2", Path("../../admin-key")), "evil.qcow2: its backing file is not in your files"),
    "an external data file at DATA_DIR -> refused": (
        lambda b: with_data_file(b, "evil.qcow2", b.data / "admin-key-data"),
        "evil.qcow2: an external data file is not supported"),
    "a vmdk descriptor whose extent is the admin key -> refused": (
        lambda b: vmdk_descriptor(b, "evil.vmdk", b.admin_key), "evil.vmdk: format vmdk is not supported"),
    "a backing file in another owner's files -> refused": (
        lambda b: b.qcow2("evil.qcow2", b.raw("theirs.raw", owner="bob")),
        "evil.qcow2: its backing file is not in your files"),
    "a backing file in a shared root (one root per disk) -> refused": (
        lambda b: b.qcow2("mine.qcow2", b.qcow2("base.qcow2", where=b.pool), "qcow2"),
        "mine.qcow2: its backing file is not in your files"),
    "another owner's image -> refused": (lambda b: b.raw("theirs.raw", owner="bob"), "theirs.raw: not in your files"),
    "the admin key as the image -> refused": (lambda b: b.admin_key, "admin-key: not in your files"),
    "an image gone since it was named -> refused": (
        lambda b: b.files() / "gone.raw", "gone.raw: not found in your files"),
    "a 1 PiB virtual disk (the overlay could grow without end) -> refused, naming the cap": (
        lambda b: b.qcow2("huge.qcow2", size="1P"),
        "huge.qcow2: its virtual size 1024Ti is over the 50Gi disk cap of class cpu-1c-4g"),
    "an image the owner's uid cannot read -> refused": (
        lambda b: unreadable(b.raw("private.raw")), "the disk image private.raw is not readable by the sandbox"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_an_image_leaving_the_owners_files_fails_the_replica_before_qemu_starts(
        box: Box, tmp_path: Path, case: tuple[Callable[[Box], Path], str]) -> None:
    build, reason = case
    image = build(box)
    status = box.start("evil", image)  # it returns the refusal: nothing waited on the FIFO (the timeout mark)
    assert status.state is ReplicaState.FAILED and status.detail.startswith(reason), status.detail
    assert str(tmp_path) not in status.detail  # no host path
    assert wait_for(box.driver, rid("evil"), {ReplicaState.FAILED}).detail == status.detail
    # no QEMU, no sandbox, no overlay; the admin key never opened
    m = box.driver._read(rid("evil"))
    assert m is not None and m["pid"] is None
    assert qemu_processes(rid("evil")) == [] and box.driver.runc.list() == []
    assert not box.overlay("evil").exists()
    assert nobody_reads(box.admin_key)


def appends(pid: int, path: Path) -> bool:
    """Whether process ``pid`` holds ``path`` open for appending (O_APPEND: its next write lands at the end of
    the file as it is then, so a log the driver truncates starts again from nothing)."""
    want = path.stat()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            st = fd.stat()  # the file itself, whatever its path inside the sandbox
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                flags = int(dict(line.split(":", 1) for line in Path(f"/proc/{pid}/fdinfo/{fd.name}")
                                 .read_text().splitlines())["flags"].strip(), 8)
                return bool(flags & os.O_APPEND)
    raise AssertionError(f"process {pid} does not hold {path} open")


@pytest.mark.timeout(120)
def test_a_vms_console_and_log_stay_bounded_and_its_access_shows_no_host_path(box: Box) -> None:
    """The console grew ~80 KB/s from a guest, and a replica's log as fast as its process writes: each is cut
    back to its cap (16 MiB, one rotated file beside it) when the driver observes. What the owner is shown of
    the VM names no host path."""
    status = box.start("logs", None)
    m = running(box, "logs")
    console, out = box.driver.root / rid("logs") / "vm" / "console.log", box.driver.root / rid("logs") / "out.log"
    qemu = next(p for p in qemu_processes(rid("logs")) if Path(f"/proc/{p}").stat().st_uid == UID)
    assert appends(qemu, console)
    # 1. 64 MiB in each, as a chatty guest and process would write them
    for log in (console, out):
        with log.open("ab") as f:
            for _ in range(64):
                f.write(b"x" * (MIB - 1) + b"\n")
    seen = wait_for(box.driver, rid("logs"), {ReplicaState.RUNNING})
    # 2. each back under its cap, what was last written kept in one rotated file
    for log in (console, out):
        rotated = sorted(p for p in log.parent.parent.rglob(f"{log.name}*") if p != log)
        assert log.stat().st_size <= 16 * MIB, log
        assert sum(p.stat().st_size for p in rotated) <= 16 * MIB, rotated
    # 3. QEMU writes on, from the start of the file it still holds
    qmp(m["socket"], {"execute": "human-monitor-command", "arguments": {"command-line": "info status"}})
    assert appends(qemu, console)
    # 4. what its owner is shown: no host path
    for shown in (status, seen):
        assert str(box.tmp) not in repr(shown) and "/tmp/" not in repr(shown), shown
    stop(box, "logs")


IMAGE_ROOTS = {
    "in the owner's files -> the owner's dir": ("/d/files/o1/vm/disk.raw", "/d/files/o1"),
    "in a shared root -> that root": ("/srv/pool/os.qcow2", "/srv/pool"),
    "nested roots -> the deepest": ("/srv/pool/inner/os.qcow2", "/srv/pool/inner"),
    "a root itself -> none": ("/d/files/o1", None),
    "another owner's files -> none": ("/d/files/o2/disk.raw", None),
    "a prefix that is no parent -> none": ("/d/files/o1x/disk.raw", None),
}


@pytest.mark.parametrize("case", IMAGE_ROOTS.values(), ids=IMAGE_ROOTS.keys())
def test_image_root(case: tuple[str, str | None]) -> None:
    image, want = case
    roots = [Path("/d/files/o1"), Path("/srv/pool"), Path("/srv/pool/inner")]
    assert plan.image_root(Path(image), roots) == (Path(want) if want else None)
