"""A notebook's home with a bound of its own: an ext4 file system in an image file, loop-mounted.

The home (``DATA_DIR/workdirs/<workload>``) is on the same file system as the database, the spool and the
other owners' files, so a home with no bound lets one notebook fill the disk for everyone. Where the driver
runs as root (which it must to sandbox), each home is a sparse image of the bound's size next to it
(``<workload>.img``: it takes only what the notebook wrote), formatted ext4 with the owner's uid owning its
root and no blocks kept back for root, and mounted at the home with ``nosuid,nodev``: a notebook that fills
it gets ENOSPC inside, and nothing else on the host notices. The mount outlives ``tensora up`` as the sandbox
does (a new driver finds it mounted); after a reboot the image is mounted again. ``release`` unmounts it and
removes the image with the workload.

Why not project quotas: they need the host's file system mounted with ``prjquota`` (ext4) or ``pquota``
(XFS), which a newcomer's machine never is; a loop device needs only root. Where neither works (no root:
``isolation: none`` as an ordinary user, or a host without loop devices), :func:`mount` raises
:class:`NoBound` and the driver measures the home instead (:func:`usage`), stopping a notebook whose home
passed its bound: a real bound, but checked between observes, not at each write.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tensora.units import format_memory

MOUNT_OPTIONS = "loop,nosuid,nodev"
TOOL_TIMEOUT_S = 60.0
FULL_BELOW = 1 << 20
"""A mounted home with less room than this left is full (its owner's writes fail with ENOSPC)."""


class NoBound(Exception):
    """This host cannot mount a home of its own (the message says why): the driver measures it instead."""


@dataclass(frozen=True, slots=True)
class HomeBound:
    """The bound of a notebook's home: its size, and how it holds (``mounted`` an image, or ``measured``)."""

    size: int
    mounted: bool

    def full(self) -> str:
        """The reason a notebook gives when its home is full."""
        return f"its home is full: {format_memory(self.size)}, the bound of a notebook's home"


def image_of(home: Path) -> Path:
    return home.with_name(home.name + ".img")


def mount(home: Path, size: int, uid: int, gid: int) -> None:
    """Mount ``home``'s image at ``home`` (made, ``size`` bytes, when it is not there yet), unless mounted
    already. What an older, unbounded home held is moved into it. NoBound when this host cannot; OSError
    (ENOSPC) when the older home does not fit."""
    if os.path.ismount(home):
        return
    if os.geteuid() != 0:
        raise NoBound("mounting a home needs root")
    for tool in ("mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise NoBound(f"{tool} is not installed")
    image = image_of(home)
    fresh = not image.exists()
    if fresh:
        _make(image, size, uid, gid)
    home.mkdir(mode=0o700, exist_ok=True)
    aside = home.with_name(home.name + ".old")  # an unbounded home from before, moved aside (or cut short)
    if any(home.iterdir()):  # its files move into the bounded one
        if aside.exists():
            shutil.copytree(home, aside, symlinks=True, dirs_exist_ok=True)
            shutil.rmtree(home)
        else:
            home.rename(aside)
        home.mkdir(mode=0o700)
    older = aside if aside.exists() else None
    try:
        _run(["mount", "-o", MOUNT_OPTIONS, str(image), str(home)], "mount the home")
    except NoBound:
        if older is not None:  # as it was: the older home, unbounded
            home.rmdir()
            older.rename(home)
        raise
    os.chmod(home, 0o700)
    if fresh:  # e2fsck makes it again when it needs one; a notebook's file browser need not show it
        with contextlib.suppress(OSError):
            (home / "lost+found").rmdir()
    if older is not None:
        shutil.copytree(older, home, symlinks=True, dirs_exist_ok=True)
        for where, dirs, files in os.walk(home):
            for name in (where, *(os.path.join(where, n) for n in dirs + files)):
                os.lchown(name, uid, gid)
        shutil.rmtree(older, ignore_errors=True)


def _make(image: Path, size: int, uid: int, gid: int) -> None:
    """A sparse image of ``size`` bytes holding an empty ext4 whose root is the owner's, made under a temp
    name and renamed: a crash never leaves half a file system under the image's name."""
    tmp = image.with_name(f".{image.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        # -m 0: no blocks kept for root (the owner may use all of it); lazy init of the inode tables and the
        # journal: the image stays sparse (a 10 GiB home takes about 4 MiB until written, 69 MiB without)
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E",
              f"root_owner={uid}:{gid},lazy_itable_init=1,lazy_journal_init=1", str(tmp)],
             "make the home's file system")
        os.replace(tmp, image)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unmount(home: Path) -> None:
    """Unmount ``home`` (lazily when something still holds it) and remove its image (and what an older home
    left moved aside)."""
    if os.path.ismount(home):
        done = subprocess.run(["umount", str(home)], capture_output=True, check=False, timeout=TOOL_TIMEOUT_S)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(home)], capture_output=True, check=False, timeout=TOOL_TIMEOUT_S)
    with contextlib.suppress(FileNotFoundError):
        image_of(home).unlink()
    shutil.rmtree(home.with_name(home.name + ".old"), ignore_errors=True)


def room(home: Path) -> int | None:
    """Bytes the owner may still write in a mounted home; None when it is not mounted."""
    if not os.path.ismount(home):
        return None
    st = os.statvfs(home)
    return st.f_bavail * st.f_frsize


def usage(home: Path) -> int:
    """Bytes the files under ``home`` take on disk (allocated blocks, links not followed): the measured bound."""
    total = 0
    for where, dirs, files in os.walk(home):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(where, name)).st_blocks * 512
    return total


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NoBound(f"could not {what}: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no reason given"]
        raise NoBound(f"could not {what}: {last[0]}")
