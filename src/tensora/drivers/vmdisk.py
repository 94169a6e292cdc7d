"""A VM's disk: an owner's image checked without opening anything outside the owner's files, a
copy-on-write overlay per VM, and QEMU arguments that name every format and every backing node.

The attack this stops: an owner uploads a small qcow2 whose header names ``DATA_DIR/admin-key`` as its
backing file (or as its external data file, or a vmdk descriptor whose extent is that file); anything that
opens the image the way QEMU does by default then opens the admin key with Tensora's rights.

What qemu-img opens (measured with strace, QEMU 7.2, a FIFO as the "host file" so an open hangs):

* ``qemu-img info --backing-chain`` opens every backing file named in the headers: the attack works on it.
* ``qemu-img info`` without ``-f`` probes the format, and probing a vmdk descriptor opens its extents, which
  may name any host file.
* ``qemu-img info -f FMT`` without ``--backing-chain`` opens only the file given: not its backing file,
  nor a qcow2 external data file.
* ``qemu-img create -b BASE`` opens BASE and its whole chain, even with a size given; ``-u`` with a size
  opens only the new file.

So :func:`inspect` reads each header itself, in Python, and walks the backing chain link by link, refusing a
link that leaves the owner's files before anything opens it; only then does it ask qemu-img about each link
that was checked, with the format it chose (``-f``, never a probe) and without ``--backing-chain``, and
refuses when qemu-img sees anything the Python reader did not. :func:`overlay` creates with ``-u``.
:func:`qemu_disk_args` gives QEMU every link as a ``-blockdev`` node with its driver and its backing node
named (the last one ``null``), so QEMU never probes a format and never follows a name from a header.

Left to the caller: QEMU should run in the replica's sandbox (the owner's uid, only the owner's files and the
replica's dir mounted), which is the second wall. An upload replaces a file by a rename, so :func:`overlay`
re-checks that every link is still the same inode as when it was inspected; between that and QEMU's own
open only the sandbox guards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import struct
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from tensora.errors import TensoraError
from tensora.units import format_memory

QCOW2_MAGIC = b"QFI\xfb"
HEAD_BYTES = 2 * 2**20
"""Bytes read from the start of an image: a qcow2 header, its extensions and its backing file name all lie
in the first cluster, which is at most 2 MiB."""
MAX_CHAIN = 16
"""Links in a backing chain, the top image included."""
QEMU_IMG_TIMEOUT_S = 30.0
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
"""QEMU's seccomp filter; QEMU 7.2 (Debian 12) supports each of these options."""

# qcow2 (docs/interop/qcow2.txt)
_EXT_END = 0x00000000
_EXT_BACKING_FORMAT = 0xE2792ACA
_EXT_DATA_FILE = 0x44415441
_INCOMPAT_DATA_FILE = 1 << 2
_MAX_BACKING_NAME = 1023


class ImageRefused(TensoraError):
    """A VM's disk image cannot be used: a format other than raw or qcow2, a backing or data file outside the
    owner's files, or qemu-img could not read it. The message names the image as the owner does (its path
    inside their files) and never a host path."""

    def __init__(self, image: str, reason: str) -> None:
        self.image = image
        self.reason = reason
        super().__init__(f"{image}: {reason}")


class DiskFormat(StrEnum):
    """The formats a VM's disk may have; QEMU is always told which."""

    RAW = "raw"
    QCOW2 = "qcow2"


@dataclass(frozen=True, slots=True)
class Layer:
    """One image of a backing chain: its resolved path (inside the owner's files), its name there, its
    format, its size as qemu-img reports it, and the file's identity when checked (dev, inode, size, mtime)."""

    path: Path
    name: str
    format: DiskFormat
    virtual_size: int
    identity: tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """A checked image: ``chain[0]`` is the image the owner named, each next one the backing file of the one
    before it. Every link is inside the owner's files and is raw or qcow2."""

    chain: tuple[Layer, ...]

    @property
    def path(self) -> Path:
        return self.chain[0].path

    @property
    def format(self) -> DiskFormat:
        return self.chain[0].format

    @property
    def virtual_size(self) -> int:
        return self.chain[0].virtual_size


@dataclass(frozen=True, slots=True)
class Qcow2Header:
    """What of a qcow2 header decides which other files QEMU would open."""

    version: int
    size: int
    crypt_method: int
    incompatible: int
    backing_file: bytes | None
    backing_format: bytes | None
    data_file: bytes | None

    @property
    def external_data(self) -> bool:
        return bool(self.incompatible & _INCOMPAT_DATA_FILE) or self.data_file is not None


class HeaderError(ValueError):
    """A qcow2 header that QEMU would not open either (truncated, offsets out of range)."""


def parse_qcow2(head: bytes) -> Qcow2Header:
    """The qcow2 header at the start of ``head`` (which holds at least the image's first cluster, or the
    whole file when shorter). Pure; raises :class:`HeaderError` on anything malformed."""
    if len(head) < 72 or head[:4] != QCOW2_MAGIC:
        raise HeaderError("not a qcow2 header")
    version, backing_offset, backing_size, cluster_bits, size, crypt_method = struct.unpack_from(">IQIIQI", head, 4)
    if version not in (2, 3):
        raise HeaderError(f"qcow2 version {version}")
    if not 9 <= cluster_bits <= 21:
        raise HeaderError(f"cluster bits {cluster_bits}")
    cluster = 1 << cluster_bits
    incompatible, header_length = 0, 72
    if version == 3:
        if len(head) < 104:
            raise HeaderError("truncated version 3 header")
        incompatible = struct.unpack_from(">Q", head, 72)[0]
        header_length = struct.unpack_from(">I", head, 100)[0]
        if header_length < 104 or header_length > cluster:
            raise HeaderError(f"header length {header_length}")
    if backing_offset > cluster:
        raise HeaderError("backing file name outside the first cluster")
    backing_file = None
    if backing_offset and backing_size:
        if backing_size > min(_MAX_BACKING_NAME, cluster - backing_offset):
            raise HeaderError("backing file name too long")
        backing_file = _slice(head, backing_offset, backing_size)
    backing_format, data_file = _extensions(head, header_length, backing_offset or cluster)
    return Qcow2Header(version=version, size=size, crypt_method=crypt_method, incompatible=incompatible,
                       backing_file=backing_file, backing_format=backing_format, data_file=data_file)


def _extensions(head: bytes, offset: int, end: int) -> tuple[bytes | None, bytes | None]:
    """(backing format, external data file name) from the header extensions, walked as QEMU walks them."""
    backing_format = data_file = None
    while offset < end:
        if offset + 8 > end:
            raise HeaderError("truncated header extension")
        kind, length = struct.unpack_from(">II", _slice(head, offset, 8))
        offset += 8
        if kind == _EXT_END:
            break
        if length > end - offset:
            raise HeaderError("header extension too large")
        data = _slice(head, offset, length)
        if kind == _EXT_BACKING_FORMAT:
            backing_format = data
        elif kind == _EXT_DATA_FILE:
            data_file = data
        offset += (length + 7) & ~7
    return backing_format, data_file


def _slice(head: bytes, offset: int, length: int) -> bytes:
    if offset + length > len(head):
        raise HeaderError("header runs past the end of the file")
    return head[offset:offset + length]


def probe(head: bytes) -> str:
    """The format an image's first bytes show: ``raw`` or ``qcow2``, or the name of another format QEMU
    would recognize (refused). Pure. Raw is what is left: with ``-f raw`` QEMU interprets nothing, so a
    format missed here is shown to the guest as bytes, never opened as that format."""
    if head[:4] == QCOW2_MAGIC:
        version = struct.unpack_from(">I", head, 4)[0] if len(head) >= 8 else 0
        return {1: "qcow", 2: "qcow2", 3: "qcow2"}.get(version, "qcow2 of an unknown version")
    for magic, name in _MAGICS:
        if head.startswith(magic):
            return name
    if len(head) >= 0x44 and struct.unpack_from("<I", head, 0x40)[0] == 0xBEDA107F:
        return "vdi"
    if _vmdk_descriptor(head[:2048]):
        return "vmdk"
    return "raw"


_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"QED\x00", "qed"),
    (b"KDMV", "vmdk"),
    (b"COWD", "vmdk"),
    (b"vhdxfile", "vhdx"),
    (b"conectix", "vpc"),
    (b"WithoutFreeSpace", "parallels"),
    (b"WithouFreSpacExt", "parallels"),
    (b"Bochs Virtual HD Image", "bochs"),
    (b"LUKS\xba\xbe", "luks"),
    (b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop", "cloop"),
)


def _vmdk_descriptor(head: bytes) -> bool:
    """QEMU's vmdk probe for a text descriptor: comment and blank lines, then ``version=1|2|3``."""
    for line in head.split(b"\n"):
        if line.startswith(b"#"):
            continue
        if line.strip(b" \r") == b"":
            continue
        return line.rstrip(b"\r") in (b"version=1", b"version=2", b"version=3")
    return False


def backing_target(parent: Path, name: bytes) -> Path | None:
    """Where QEMU would look for backing file ``name`` of the image at ``parent`` (resolved), resolved in
    turn; None for a name that is not a plain file path (``json:{...}``, ``nbd://``, ``file:``, any
    ``protocol:`` prefix, a NUL). Reads no file, only resolves symlinks."""
    if b"\x00" in name or not name:
        return None
    text = os.fsdecode(name)
    if text.startswith("json:"):
        return None
    colon, slash = text.find(":"), text.find("/")
    if colon >= 0 and (slash < 0 or colon < slash):
        return None
    return (parent.parent / text).resolve()


def inspect(image: Path, allowed_root: Path, cap: DiskCap | None = None) -> ImageInfo:
    """Check ``image`` and its whole backing chain; raise :class:`ImageRefused` unless every link is a raw
    or qcow2 file inside ``allowed_root`` (the owner's files) with no external data file and no encryption,
    and the disk the guest sees (the image's virtual size) is within ``cap``: its overlay grows up to that.

    Nothing outside ``allowed_root`` is opened: headers are read here, link by link, and qemu-img is run only
    on links already checked, each with the format chosen here."""
    root = allowed_root.resolve()
    links = _walk(image.resolve(), root, image.name)
    info = ImageInfo(chain=tuple(_qemu_img_check(link, root) for link in links))
    if cap is not None and info.virtual_size > cap.size:
        raise ImageRefused(info.chain[0].name, f"its virtual size {format_memory(info.virtual_size)} is over the "
                                               f"{format_memory(cap.size)} disk cap of {cap.of}")
    return info


@dataclass(frozen=True, slots=True)
class DiskCap:
    """The largest virtual size a VM's disk may have (``size``, bytes), and whose bound it is (``of``: ``class
    cpu-1c-4g``), for the reason a refusal gives."""

    size: int
    of: str


@dataclass(frozen=True, slots=True)
class _Link:
    """A link as the header reader saw it, before qemu-img is asked."""

    path: Path
    name: str
    format: DiskFormat
    header: Qcow2Header | None
    identity: tuple[int, int, int, int]


def _walk(top: Path, root: Path, shown: str) -> list[_Link]:
    links: list[_Link] = []
    seen: set[tuple[int, int]] = set()
    path: Path | None = top
    declared: DiskFormat | None = None
    name = _name(top, root) or shown
    while path is not None:
        # 1. the link must be a regular file inside the owner's files, opened without following a link
        if not _inside(path, root):
            raise ImageRefused(name, "its backing file is not in your files" if links else "not in your files")
        name = _name(path, root) or shown
        if len(links) == MAX_CHAIN:
            raise ImageRefused(name, f"the backing chain is longer than {MAX_CHAIN} images")
        head, identity = _read_head(path, name)
        if identity[:2] in seen:
            raise ImageRefused(name, "the backing chain loops")
        seen.add(identity[:2])
        # 2. its format: the one its parent declared, else what its bytes show; only raw and qcow2
        fmt = declared or _format(probe(head), name)
        if fmt is DiskFormat.RAW:
            links.append(_Link(path, name, fmt, None, identity))
            break
        # 3. a qcow2: no data file, no encryption; its backing file (if any) is the next link
        try:
            header = parse_qcow2(head)
        except HeaderError as e:
            raise ImageRefused(name, f"not a valid qcow2 image ({e})") from None
        if header.external_data:
            raise ImageRefused(name, "an external data file is not supported (qemu-img convert -O qcow2 it)")
        if header.crypt_method:
            raise ImageRefused(name, "encrypted images are not supported")
        links.append(_Link(path, name, fmt, header, identity))
        if header.backing_file is None:
            break
        path = backing_target(path, header.backing_file)
        if path is None:
            raise ImageRefused(name, "its backing file is not a file in your files (json: or protocol name)")
        declared = _declared(header.backing_format, name)
    return links


def _inside(path: Path, root: Path) -> bool:
    return path != root and path.is_relative_to(root)


def _name(path: Path, root: Path) -> str:
    """The image as the owner names it: its path inside their files."""
    return path.relative_to(root).as_posix() if _inside(path, root) else ""


def _format(probed: str, name: str) -> DiskFormat:
    try:
        return DiskFormat(probed)
    except ValueError:
        raise ImageRefused(name, f"format {probed} is not supported: use raw or qcow2 "
                                 "(qemu-img convert -O qcow2)") from None


def _declared(backing_format: bytes | None, name: str) -> DiskFormat | None:
    if backing_format is None:
        return None
    try:
        return DiskFormat(backing_format.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        shown = backing_format.decode("ascii", "replace")
        raise ImageRefused(name, f"its backing file's format {shown} is not supported: use raw or qcow2") from None


def _read_head(path: Path, name: str) -> tuple[bytes, tuple[int, int, int, int]]:
    """The first :data:`HEAD_BYTES` of a regular file, and its identity. O_NONBLOCK so that a FIFO cannot
    hang the open, O_NOFOLLOW since the path is already resolved."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise ImageRefused(name, "not found in your files") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageRefused(name, "not a regular file")
        chunks: list[bytes] = []
        left = min(HEAD_BYTES, st.st_size)
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise ImageRefused(name, f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    return b"".join(chunks), _identity(st)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _qemu_img_check(link: _Link, root: Path) -> Layer:
    """qemu-img's view of one checked link, asked with its format and without ``--backing-chain``: it must
    see no more than the header reader did (same backing name, no data file, not encrypted)."""
    name, fmt = link.name, link.format
    out = _qemu_img(["info", "--output=json", "-U", "-f", fmt.value, str(link.path)], name, root)
    try:
        info: dict[str, Any] = json.loads(out)
        size = int(info["virtual-size"])
        data = (info.get("format-specific") or {}).get("data") or {}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ImageRefused(name, "qemu-img gave an answer Tensora cannot read") from None
    backing = link.header.backing_file if link.header else None
    seen_backing = info.get("backing-filename")
    if (info.get("format") != fmt.value or info.get("encrypted") or "data-file" in data
            or (seen_backing is None) != (backing is None)
            or (backing is not None and os.fsencode(str(seen_backing)) != backing)):
        raise ImageRefused(name, "qemu-img sees this image differently from Tensora's check; refused")
    return Layer(path=link.path, name=name, format=fmt, virtual_size=size, identity=link.identity)


def _qemu_img(args: list[str], name: str, root: Path) -> str:
    """Run qemu-img (argv, no shell, a timeout, a bare environment); its stdout, or :class:`ImageRefused`
    whose message has the owner's root cut from qemu-img's words."""
    exe = shutil.which("qemu-img")
    if exe is None:
        raise ImageRefused(name, "qemu-img is not installed on this node (apt-get install qemu-utils)")
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=QEMU_IMG_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, env={"PATH": os.defpath, "LC_ALL": "C"}, check=False)
    except subprocess.TimeoutExpired:
        raise ImageRefused(name, f"qemu-img took longer than {QEMU_IMG_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise ImageRefused(name, f"qemu-img failed: {_scrub(done.stderr, root)}")
    return done.stdout


def _scrub(text: str, root: Path) -> str:
    """qemu-img's last line, with the owner's root cut so only names inside their files remain."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "no reason given"
    last = last.replace(str(root) + "/", "").replace(str(root), ".")
    return last.removeprefix("qemu-img: ")[:300]


def overlay(info: ImageInfo, dest: Path) -> Path:
    """The VM's copy-on-write overlay at ``dest`` (in the replica's dir), over the checked ``info``: the VM
    writes only there and the owner's image stays intact. An overlay already at ``dest`` is kept (the
    VM's disk across restarts of the replica) once its header shows a plain qcow2 over this image.

    Refused if any link changed since :func:`inspect` (an upload renames a new file over the old)."""
    for layer in info.chain:
        try:
            now = _identity(os.stat(layer.path, follow_symlinks=False))
        except OSError:
            now = None
        if now != layer.identity:
            raise ImageRefused(layer.name, "changed since it was checked; start the VM again")
    if dest.exists() or dest.is_symlink():
        _check_overlay(dest, info)
        return dest
    tmp = dest.absolute().with_name(f".{dest.name}.tmp")  # absolute: "a:b" would read as a protocol
    tmp.unlink(missing_ok=True)
    try:
        # -u with a size: qemu-img opens only the new file, not the base (see the module's docstring)
        _qemu_img(["create", "-q", "-f", "qcow2", "-F", info.format.value, "-b", str(info.path), "-u",
                   str(tmp), str(info.virtual_size)], dest.name, tmp.parent)
        tmp.chmod(0o600)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return dest


def _check_overlay(dest: Path, info: ImageInfo) -> None:
    head, _ = _read_head(dest, dest.name)
    try:
        header = parse_qcow2(head)
    except HeaderError as e:
        raise ImageRefused(dest.name, f"the existing overlay is not a valid qcow2 ({e})") from None
    if (header.external_data or header.crypt_method or header.backing_file != os.fsencode(str(info.path))
            or header.backing_format != info.format.value.encode()):
        raise ImageRefused(dest.name, "the existing overlay was not made for this image")


def qemu_disk_args(overlay: Path, info: ImageInfo, *, node: str = "disk0",
                   mounts: Mapping[Path, Path] | None = None) -> list[str]:
    """QEMU arguments attaching ``overlay`` (qcow2, writable) over the checked chain ``info`` (read-only) as
    a virtio disk. Every link is a ``-blockdev`` file node plus a format node naming its driver; each qcow2
    node names its backing node (the last ``null``), so QEMU neither probes a format nor follows a backing
    file name from a header. ``mounts`` maps host dirs to where the sandbox mounts them (paths are as QEMU
    sees them). Pure."""
    names = [node] + [f"{node}-base{i}" for i in range(1, len(info.chain) + 1)]
    links = [(overlay, DiskFormat.QCOW2, False), *((link.path, link.format, True) for link in info.chain)]
    args: list[str] = []
    for i in reversed(range(len(links))):
        path, fmt, read_only = links[i]
        file_node = {"driver": "file", "node-name": f"{names[i]}-file", "filename": str(_where(path, mounts)),
                     "read-only": read_only}
        fmt_node: dict[str, Any] = {"driver": fmt.value, "node-name": names[i], "file": f"{names[i]}-file",
                                    "read-only": read_only}
        if fmt is DiskFormat.QCOW2:
            fmt_node["backing"] = names[i + 1] if i + 1 < len(links) else None
        args += ["-blockdev", json.dumps(file_node, separators=(",", ":")),
                 "-blockdev", json.dumps(fmt_node, separators=(",", ":"))]
    return [*args, "-device", f"virtio-blk-pci,drive={node},id={node}-dev"]


def _where(path: Path, mounts: Mapping[Path, Path] | None) -> Path:
    if not mounts:
        return path
    for host in sorted(mounts, key=lambda p: len(p.parts), reverse=True):
        if path.is_relative_to(host):
            return mounts[host] / path.relative_to(host)
    raise ValueError(f"{path} is under none of the sandbox's mounts")


def qemu_sandbox_args() -> list[str]:
    """QEMU's own seccomp filter: no obsolete syscalls, no setuid/setgid, no fork/exec, no scheduler or
    affinity changes."""
    return ["-sandbox", SANDBOX]
