"""A VM's disk (drivers.vmdisk): owners' images checked with real qemu-img, the attack (a qcow2 whose backing
file is DATA_DIR/admin-key) refused before anything opens the key, overlays that leave the base intact, and a
real QEMU started with the arguments built here.

The admin key in these tests is a FIFO: opening a FIFO for reading blocks until a writer comes, so anything
that opens it (Python, qemu-img, QEMU) hangs, and a refusal that comes back at once proves it was not opened.
``test_the_fifo_would_catch_an_open`` shows that plain ``qemu-img info --backing-chain`` does hang on it."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tensora.drivers.vmdisk import (
    DiskCap,
    DiskFormat,
    HeaderError,
    ImageInfo,
    ImageRefused,
    Layer,
    backing_target,
    inspect,
    overlay,
    parse_qcow2,
    probe,
    qemu_disk_args,
    qemu_sandbox_args,
)

MIB = 2**20


class Files:
    """A DATA_DIR with the admin key (a FIFO) and one owner's files; builders for images in them."""

    def __init__(self, tmp: Path) -> None:
        self.data = tmp / "data"
        self.root = self.data / "files" / "owner-1"
        self.root.mkdir(parents=True)
        self.admin_key = self.data / "admin-key"
        os.mkfifo(self.admin_key)

    def raw(self, name: str, size: int = MIB, fill: bytes = b"\x5a") -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fill * size)
        return path

    def qcow2(self, name: str, backing: str | Path | None = None, fmt: str = "raw", size: int = MIB) -> Path:
        """A qcow2; ``backing`` is written as given (``-u``: qemu-img does not open it)."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        back = ["-b", str(backing), "-F", fmt, "-u"] if backing is not None else []
        qemu_img("create", "-q", "-f", "qcow2", *back, str(path), str(size))
        return path

    def rebase(self, path: Path, backing: str, fmt: str = "raw") -> Path:
        """Rewrite ``path``'s backing file name as given, opening nothing (``rebase -u``)."""
        qemu_img("rebase", "-u", "-b", backing, "-F", fmt, str(path))
        return path

    def fmt(self, name: str, fmt: str, *opts: str) -> Path:
        path = self.root / name
        try:
            qemu_img("create", "-q", *opts, "-f", fmt, str(path), str(MIB))
        except subprocess.CalledProcessError as exc:
            if UNTIMED not in exc.stderr:
                raise
            encrypted_by_hand(path, fmt)
        return path


UNTIMED = "Unable to get accurate CPU usage"
"""qemu-img making a LUKS key times its PBKDF by the CPU time it used, and gives up when that reads 0 (a busy
machine): then the encrypted image's header is written here, which is all ``inspect`` reads of it."""


def encrypted_by_hand(path: Path, fmt: str) -> None:
    """A LUKS1 header (its magic and version), or a qcow2 whose header says LUKS encryption (crypt_method 2)."""
    if fmt == "luks":
        path.write_bytes(b"LUKS\xba\xbe" + (1).to_bytes(2, "big") + b"aes".ljust(32, b"\0") + bytes(4096))
        return
    qemu_img("create", "-q", "-f", "qcow2", str(path), str(MIB))
    with path.open("r+b") as f:
        f.seek(32)
        f.write((2).to_bytes(4, "big"))


def qemu_img(*args: str) -> str:
    for _ in range(5):
        done = subprocess.run(["qemu-img", *args], capture_output=True, text=True, timeout=30)
        if UNTIMED not in done.stderr:
            break
    done.check_returncode()
    return done.stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def nobody_reads(fifo: Path) -> bool:
    """True when no process has the FIFO open for reading now (opening it to write would fail)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        return e.errno == errno.ENXIO
    os.close(fd)
    return False


@pytest.fixture
def files(tmp_path: Path) -> Files:
    return Files(tmp_path)


# -- inspect: what is accepted, what is refused, with real qemu-img ---------------------------------------------


def with_data_file(f: Files, name: str, data_file: Path, fifo: bool = False) -> Path:
    """A qcow2 whose external data file is ``data_file``; made a FIFO afterwards when asked, so that
    opening it would hang."""
    path = f.root / name
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={data_file}", str(path), str(MIB))
    if fifo:
        data_file.unlink()
        os.mkfifo(data_file)
    return path


@dataclass(frozen=True)
class Case:
    build: Callable[[Files], Path]
    chain: tuple[str, ...] = ()
    refused: str = ""


def loop(f: Files) -> Path:
    a = f.qcow2("a.qcow2", "b.qcow2", "qcow2")
    f.qcow2("b.qcow2", "a.qcow2", "qcow2")
    return a


def vmdk_descriptor(f: Files, name: str, extent: Path) -> Path:
    """A vmdk descriptor (text) whose one extent is ``extent``: qemu-img probing it opens the extent."""
    path = f.root / name
    path.write_text('# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n'
                    f'createType="monolithicFlat"\nRW 2048 FLAT "{extent}" 0\n')
    return path


def undeclared(path: Path) -> Path:
    """Drop the backing format from a qcow2's header (as images from before QEMU 6.1 have none): its header
    extension becomes one of an unknown type, which QEMU skips."""
    raw = path.read_bytes()
    assert raw.count(b"\xe2\x79\x2a\xca") == 1
    path.write_bytes(raw.replace(b"\xe2\x79\x2a\xca", b"\x12\x34\x56\x78"))
    return path


def unknown_feature(f: Files) -> Path:
    path = f.qcow2("odd.qcow2")
    with path.open("r+b") as fh:
        fh.seek(72)
        fh.write((1 << 10).to_bytes(8, "big"))
    return path


CASES = {
    "a raw image -> accepted": Case(lambda f: f.raw("disk.raw"), chain=("raw",)),
    "a qcow2 image -> accepted": Case(lambda f: f.qcow2("disk.qcow2"), chain=("qcow2",)),
    "a qcow2 over a raw base in the owner's files (absolute name) -> accepted": Case(
        lambda f: f.qcow2("top.qcow2", f.raw("base.raw")), chain=("qcow2", "raw")),
    "a relative backing name inside the files -> accepted": Case(
        lambda f: (f.raw("images/base.raw"), f.qcow2("vm/top.qcow2", "../images/base.raw"))[1],
        chain=("qcow2", "raw")),
    "a chain of two qcow2 over a raw, all inside -> accepted": Case(
        lambda f: f.qcow2("c.qcow2", f.qcow2("b.qcow2", f.raw("a.raw")), "qcow2"), chain=("qcow2", "qcow2", "raw")),
    "a backing file without a declared format is probed here -> accepted": Case(
        lambda f: undeclared(f.qcow2("top.qcow2", f.qcow2("mid.qcow2"), "qcow2")),
        chain=("qcow2", "qcow2")),
    "the attack: backing file DATA_DIR/admin-key -> refused, the key never opened": Case(
        lambda f: f.qcow2("evil.qcow2", f.admin_key), refused="evil.qcow2: its backing file is not in your files"),
    "a relative backing name escaping with ../ -> refused": Case(
        lambda f: f.qcow2("evil.qcow2", "../../admin-key"), refused="its backing file is not in your files"),
    "a symlink in the files to the admin key -> refused": Case(
        lambda f: (os.symlink(f.admin_key, f.root / "key.raw"), f.qcow2("evil.qcow2", "key.raw"))[1],
        refused="its backing file is not in your files"),
    "the second link escapes -> refused": Case(
        lambda f: f.qcow2("top.qcow2", f.qcow2("mid.qcow2", f.admin_key), "qcow2"),
        refused="mid.qcow2: its backing file is not in your files"),
    "a json: backing file -> refused": Case(
        lambda f: f.rebase(f.qcow2("evil.qcow2"),
                           'json:{"driver":"raw","file":{"driver":"file","filename":"' + str(f.admin_key) + '"}}'),
        refused="json: or protocol name"),
    "an nbd:// backing file -> refused": Case(
        lambda f: f.rebase(f.qcow2("evil.qcow2"), "nbd://127.0.0.1:1/x"), refused="json: or protocol name"),
    "a file: backing file -> refused": Case(
        lambda f: f.rebase(f.qcow2("evil.qcow2"), f"file:{f.admin_key}"), refused="json: or protocol name"),
    "an external data file at the admin key -> refused": Case(
        lambda f: with_data_file(f, "evil.qcow2", f.data / "admin-key-data", fifo=True),
        refused="an external data file is not supported"),
    "an external data file inside the files -> refused too": Case(
        lambda f: with_data_file(f, "evil.qcow2", f.root / "disk-data.raw"), refused="an external data file"),
    "a vmdk descriptor whose extent is the admin key -> refused": Case(
        lambda f: vmdk_descriptor(f, "evil.vmdk", f.admin_key),
        refused="format vmdk is not supported"),
    "a sparse vmdk -> refused": Case(lambda f: f.fmt("x.vmdk", "vmdk"), refused="format vmdk is not supported"),
    "a vdi -> refused": Case(lambda f: f.fmt("x.vdi", "vdi"), refused="format vdi is not supported"),
    "a vhdx -> refused": Case(lambda f: f.fmt("x.vhdx", "vhdx"), refused="format vhdx is not supported"),
    "a qed -> refused": Case(lambda f: f.fmt("x.qed", "qed"), refused="format qed is not supported"),
    "a qcow version 1 -> refused": Case(lambda f: f.fmt("x.qcow", "qcow"), refused="format qcow is not supported"),
    "a luks image -> refused": Case(
        lambda f: f.fmt("x.luks", "luks", "--object", "secret,id=s,data=x", "-o", "key-secret=s"),
        refused="format luks is not supported"),
    "a backing format other than raw or qcow2 declared -> refused": Case(
        lambda f: f.qcow2("top.qcow2", f.fmt("x.vmdk", "vmdk"), "vmdk"), refused="format vmdk is not supported"),
    "an encrypted qcow2 -> refused": Case(
        lambda f: f.fmt("enc.qcow2", "qcow2", "--object", "secret,id=s,data=x",
                        "-o", "encrypt.format=luks,encrypt.key-secret=s"),
        refused="encrypted images are not supported"),
    "a backing chain that loops -> refused": Case(loop, refused="the backing chain loops"),
    "the image itself outside the files -> refused": Case(lambda f: f.admin_key, refused="not in your files"),
    "the image a symlink in the files to the admin key -> refused": Case(
        lambda f: (os.symlink(f.admin_key, f.root / "disk.raw"), f.root / "disk.raw")[1], refused="not in your files"),
    "a FIFO in the files -> refused without blocking": Case(
        lambda f: (os.mkfifo(f.root / "pipe.raw"), f.root / "pipe.raw")[1], refused="not a regular file"),
    "a missing image -> refused": Case(lambda f: f.root / "nothing.raw", refused="not found in your files"),
    "qemu-img cannot open it (unknown feature) -> refused, in its words, without host paths": Case(
        unknown_feature, refused="qemu-img failed: Could not open 'odd.qcow2': Unsupported qcow2 feature"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_inspect(case: Case, files: Files, tmp_path: Path) -> None:
    image = case.build(files)
    if case.refused:
        with pytest.raises(ImageRefused) as refused:
            inspect(image, files.root)
        assert case.refused in str(refused.value)
        assert str(tmp_path) not in str(refused.value)
    else:
        info = inspect(image, files.root)
        assert tuple(layer.format.value for layer in info.chain) == case.chain
        assert all(layer.path.is_relative_to(files.root) for layer in info.chain)
        assert info.virtual_size == MIB
    # nothing waited on a FIFO (a hang would meet the timeout mark): none is left open for reading either
    assert nobody_reads(files.admin_key)
    if image.is_fifo():
        assert nobody_reads(image)


CAPS = {
    "a 1 PiB qcow2 under a 50 GiB cap -> refused, naming the cap and the owner's name": (
        lambda f: f.qcow2("vm/huge.qcow2", size=2**50), 50 * 2**30,
        "vm/huge.qcow2: its virtual size 1024Ti is over the 50Gi disk cap of class cpu-1c-4g"),
    "a qcow2 of exactly the cap -> accepted": (lambda f: f.qcow2("exact.qcow2", size=4 * MIB), 4 * MIB, None),
    "a raw image one byte over the cap -> refused": (
        lambda f: f.raw("big.raw", size=MIB + 1, fill=b"\x01"), MIB, "big.raw: its virtual size 1.0Mi is over"),
    "a small qcow2 over a larger raw base: the guest sees the top's size -> accepted": (
        lambda f: f.qcow2("top.qcow2", f.raw("base.raw", size=8 * MIB), size=MIB), 2 * MIB, None),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CAPS.values(), ids=CAPS.keys())
def test_inspect_caps_the_virtual_size(case: tuple[Callable[[Files], Path], int, str | None], files: Files,
                                       tmp_path: Path) -> None:
    build, size, refused = case
    image = build(files)
    cap = DiskCap(size, "class cpu-1c-4g")
    if refused is None:
        assert inspect(image, files.root, cap).virtual_size <= size
        return
    with pytest.raises(ImageRefused) as info:
        inspect(image, files.root, cap)
    assert str(info.value).startswith(refused) and str(tmp_path) not in str(info.value)


@pytest.mark.timeout(30)
def test_the_fifo_would_catch_an_open(files: Files) -> None:
    """The control: plain ``qemu-img info --backing-chain`` on the attack image opens the key, and hangs."""
    evil = files.qcow2("evil.qcow2", files.admin_key)
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(["qemu-img", "info", "--backing-chain", "-U", str(evil)], capture_output=True, timeout=2)


# -- the pure parts: headers, probing, backing names ------------------------------------------------------------


def test_parse_qcow2_reads_backing_name_format_and_data_file(files: Files) -> None:
    base = files.raw("base.raw")
    header = parse_qcow2(files.qcow2("top.qcow2", base).read_bytes())
    assert (header.version, header.size, header.backing_file, header.backing_format) == (
        3, MIB, str(base).encode(), b"raw")
    assert not header.external_data and header.crypt_method == 0
    data = with_data_file(files, "d.qcow2", files.root / "d-data.raw")
    assert parse_qcow2(data.read_bytes()).external_data


@pytest.mark.parametrize("head", [b"", b"QFI\xfb", b"QFI\xfb" + bytes(100), b"RAW!" + bytes(200)],
                         ids=["empty", "magic only", "version 0", "not qcow2"])
def test_parse_qcow2_refuses_malformed_headers(head: bytes) -> None:
    with pytest.raises(HeaderError):
        parse_qcow2(head)


PROBES = {
    "zeros -> raw": (bytes(4096), "raw"),
    "text -> raw": (b"hello\nversion=4\n", "raw"),
    "qcow2 v3 -> qcow2": (b"QFI\xfb\x00\x00\x00\x03", "qcow2"),
    "qcow v1 -> qcow": (b"QFI\xfb\x00\x00\x00\x01", "qcow"),
    "vmdk descriptor after comments and blank lines -> vmdk": (b"# Disk DescriptorFile\n\n  \nversion=1\n", "vmdk"),
    "vdi signature at 0x40 -> vdi": (bytes(0x40) + (0xBEDA107F).to_bytes(4, "little"), "vdi"),
}


@pytest.mark.parametrize("case", PROBES.values(), ids=PROBES.keys())
def test_probe(case: tuple[bytes, str]) -> None:
    assert probe(case[0]) == case[1]


BACKING_NAMES = {
    "absolute": (b"/srv/x.raw", Path("/srv/x.raw")),
    "relative to the image's dir": (b"base.raw", Path("/files/o/vm/base.raw")),
    "../ resolved": (b"../../admin-key", Path("/files/admin-key")),
    "a colon after a slash is a file name": (b"./a:b", Path("/files/o/vm/a:b")),
    "json: pseudo-filename": (b'json:{"driver":"file","filename":"/x"}', None),
    "a protocol": (b"nbd://host/x", None),
    "file: prefix": (b"file:/x", None),
    "any name:with a colon first": (b"host_device:/dev/sda", None),
    "a NUL": (b"a\x00/etc/shadow", None),
}


@pytest.mark.parametrize("case", BACKING_NAMES.values(), ids=BACKING_NAMES.keys())
def test_backing_target(case: tuple[bytes, Path | None]) -> None:
    assert backing_target(Path("/files/o/vm/top.qcow2"), case[0]) == case[1]


# -- overlays: the VM writes only there ----------------------------------------------------------------------------


@pytest.mark.parametrize("base_fmt", ["raw", "qcow2"])
def test_writes_through_the_overlay_leave_the_base_intact(files: Files, tmp_path: Path, base_fmt: str) -> None:
    base = files.raw("base.raw") if base_fmt == "raw" else files.qcow2("base.qcow2", files.raw("under.raw"))
    before = {p: sha256(p) for p in files.root.iterdir()}
    info = inspect(base, files.root)
    replica = tmp_path / "replica"
    replica.mkdir()
    ov = overlay(info, replica / "disk.qcow2")
    assert oct(ov.stat().st_mode & 0o777) == "0o600"
    assert json.loads(qemu_img("info", "--output=json", "-U", str(ov)))["backing-filename-format"] == base_fmt
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0xab 0 4k", str(ov)], check=True, capture_output=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "read -P 0xab 0 4k", str(ov)], check=True, capture_output=True)
    assert {p: sha256(p) for p in files.root.iterdir()} == before
    assert overlay(info, ov) == ov  # kept across restarts, with what the VM wrote
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "read -P 0xab 0 4k", str(ov)], check=True, capture_output=True)


def test_an_existing_overlay_not_made_for_this_image_is_refused(files: Files, tmp_path: Path) -> None:
    info = inspect(files.raw("base.raw"), files.root)
    stray = tmp_path / "disk.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-b", str(files.admin_key), "-F", "raw", "-u", str(stray), str(MIB))
    with pytest.raises(ImageRefused, match="not made for this image"):
        overlay(info, stray)


def test_a_base_replaced_after_inspect_is_refused(files: Files, tmp_path: Path) -> None:
    base = files.raw("base.raw")
    info = inspect(base, files.root)
    files.raw("new.raw").replace(base)  # an upload renames a new file over the old
    with pytest.raises(ImageRefused, match=r"base\.raw: changed since it was checked"):
        overlay(info, tmp_path / "disk.qcow2")
    assert not (tmp_path / "disk.qcow2").exists()


# -- QEMU's arguments ------------------------------------------------------------------------------------------


def layer(path: str, fmt: DiskFormat) -> Layer:
    return Layer(path=Path(path), name=Path(path).name, format=fmt, virtual_size=MIB, identity=(0, 0, 0, 0))


def blockdevs(args: list[str]) -> list[dict[str, Any]]:
    return [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "-blockdev"]


def test_disk_args_name_every_driver_and_backing_node() -> None:
    info = ImageInfo(chain=(layer("/f/o/top.qcow2", DiskFormat.QCOW2), layer("/f/o/base.raw", DiskFormat.RAW)))
    args = qemu_disk_args(Path("/r/disk.qcow2"), info)
    assert blockdevs(args) == [
        {"driver": "file", "node-name": "disk0-base2-file", "filename": "/f/o/base.raw", "read-only": True},
        {"driver": "raw", "node-name": "disk0-base2", "file": "disk0-base2-file", "read-only": True},
        {"driver": "file", "node-name": "disk0-base1-file", "filename": "/f/o/top.qcow2", "read-only": True},
        {"driver": "qcow2", "node-name": "disk0-base1", "file": "disk0-base1-file", "read-only": True,
         "backing": "disk0-base2"},
        {"driver": "file", "node-name": "disk0-file", "filename": "/r/disk.qcow2", "read-only": False},
        {"driver": "qcow2", "node-name": "disk0", "file": "disk0-file", "read-only": False,
         "backing": "disk0-base1"},
    ]
    assert args[-2:] == ["-device", "virtio-blk-pci,drive=disk0,id=disk0-dev"]
    assert "-drive" not in args


def test_disk_args_end_a_qcow2_chain_with_a_null_backing_and_map_sandbox_paths() -> None:
    info = ImageInfo(chain=(layer("/data/files/o/base.qcow2", DiskFormat.QCOW2),))
    args = qemu_disk_args(Path("/data/replicas/r1/disk.qcow2"), info, node="vd",
                          mounts={Path("/data/files/o"): Path("/files"), Path("/data/replicas/r1"): Path("/vm")})
    nodes = {n["node-name"]: n for n in blockdevs(args)}
    assert nodes["vd-base1"]["backing"] is None
    assert (nodes["vd-base1-file"]["filename"], nodes["vd-file"]["filename"]) == ("/files/base.qcow2", "/vm/disk.qcow2")
    with pytest.raises(ValueError, match="none of the sandbox's mounts"):
        qemu_disk_args(Path("/elsewhere/disk.qcow2"), info, mounts={Path("/data/files/o"): Path("/files")})


def test_sandbox_args() -> None:
    assert qemu_sandbox_args() == [
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]


# -- a real QEMU -------------------------------------------------------------------------------------------------


class Qmp:
    """A QMP client on a unix socket, enough for these tests."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        try:
            self.sock.connect(str(path))
            self.f = self.sock.makefile("rwb")
            json.loads(self.f.readline())
            self("qmp_capabilities")
        except (OSError, ValueError):
            self.sock.close()  # not left for the garbage collector to warn about in a later test
            raise

    def __call__(self, command: str, **arguments: Any) -> Any:
        self.f.write(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n")
        self.f.flush()
        while True:
            msg = json.loads(self.f.readline() or b"{}")
            assert msg, "QMP closed the connection"
            if "event" not in msg:
                assert "error" not in msg, msg
                return msg["return"]

    def close(self) -> None:
        self.f.close()
        self.sock.close()


@pytest.fixture
def qemu(tmp_path: Path) -> Iterator[Callable[[list[str]], Qmp]]:
    """Starts qemu-system-x86_64 (no OS: the firmware finds nothing to boot) with extra args; QMP to it."""
    started: list[subprocess.Popen[bytes]] = []

    def start(extra: list[str]) -> Qmp:
        sock = tmp_path / "qmp.sock"
        kvm = os.access("/dev/kvm", os.R_OK | os.W_OK)
        # as the driver starts VMs: no -cpu host (some hosts' KVM refuses an MSR it copies, and QEMU aborts)
        accel = ["-machine", "q35,accel=kvm"] if kvm else ["-machine", "q35,accel=tcg"]
        proc = subprocess.Popen(
            [shutil.which("qemu-system-x86_64") or "qemu-system-x86_64", *accel, "-m", "128", "-nodefaults",
             "-no-user-config", "-display", "none", "-serial", f"file:{tmp_path / 'console.log'}",
             "-qmp", f"unix:{sock},server=on,wait=off", "-no-reboot", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append(proc)
        deadline = time.monotonic() + 10
        while True:
            if sock.exists():
                try:
                    return Qmp(sock)
                except OSError:  # a loaded machine: QEMU had the socket but was not listening on it yet
                    pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "QMP never answered"
            time.sleep(0.05)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.timeout(60)
def test_qemu_runs_the_overlay_with_the_formats_named_and_never_follows_a_header(
        files: Files, tmp_path: Path, qemu: Callable[[list[str]], Qmp]) -> None:
    base = files.qcow2("base.qcow2", files.raw("under.raw"))
    before = {p: sha256(p) for p in files.root.iterdir()}
    info = inspect(base, files.root)
    # the overlay's own header names the admin key as its backing file: QEMU opening it would hang
    ov = tmp_path / "disk.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-b", str(files.admin_key), "-F", "raw", "-u", str(ov), str(MIB))
    vm = qemu([*qemu_disk_args(ov, info), *qemu_sandbox_args()])
    assert vm("query-status")["status"] == "running"
    [disk] = [b for b in vm("query-block") if b.get("inserted")]
    inserted = disk["inserted"]
    assert (inserted["node-name"], inserted["drv"], inserted["backing_file"]) == ("disk0", "qcow2", str(base))
    chain = inserted["image"]
    assert (chain["format"], chain["backing-image"]["format"], chain["backing-image"]["backing-image"]["format"]) \
        == ("qcow2", "qcow2", "raw")
    assert chain["backing-image"]["filename"] == str(base)
    nodes = {n["node-name"]: n for n in vm("query-named-block-nodes")}
    assert {n: nodes[n]["drv"] for n in ("disk0", "disk0-base1", "disk0-base2")} == {
        "disk0": "qcow2", "disk0-base1": "qcow2", "disk0-base2": "raw"}
    assert nodes["disk0-base1"]["ro"] and nodes["disk0-base2"]["ro"] and not nodes["disk0"]["ro"]
    # a write through the running VM's disk lands in the overlay only
    device = "/machine/peripheral/disk0-dev/virtio-backend"
    said = vm("human-monitor-command", **{"command-line": f'qemu-io -d {device} "write -P 0xcd 0 4k"'})
    assert "rror" not in said, said  # qemu-io's own words go to QEMU's stdout; the read below checks
    vm("quit")
    vm.close()
    assert {p: sha256(p) for p in files.root.iterdir()} == before
    assert nobody_reads(files.admin_key)
    io = subprocess.run(["qemu-io", "--image-opts", "-c", "read -P 0xcd 0 4k",
                         f"driver=qcow2,file.driver=file,file.filename={ov},backing="],
                        capture_output=True, text=True, timeout=30)
    assert io.returncode == 0 and "read 4096/4096" in io.stdout, io.stdout + io.stderr
