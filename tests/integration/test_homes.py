"""A notebook's home as a file system of its own (``drivers.homes``): a real ext4 image, loop-mounted, of the
bound's size; an older unbounded home moved into it; unmounted and removed on release. The notebook that
fills one is in ``tests/e2e/test_local.py``."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensora.drivers import homes

MIB = 2**20
UID, GID = 161_234, 161_235
WHY_NOT = (None if os.geteuid() == 0 and shutil.which("mkfs.ext4") else "mounting a home needs root and mkfs.ext4")
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "workdirs" / "wl_1"
    where.parent.mkdir(mode=0o700)
    yield where
    homes.unmount(where)


def test_a_fresh_home_is_an_empty_file_system_of_its_size_owned_by_the_owner(home: Path) -> None:
    homes.mount(home, 32 * MIB, UID, GID)
    assert os.path.ismount(home)
    st = home.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, GID, 0o700)
    assert list(home.iterdir()) == []  # no lost+found shown
    vfs = os.statvfs(home)
    assert 24 * MIB < vfs.f_blocks * vfs.f_frsize <= 32 * MIB
    # no 5% kept back for root (ext4 keeps only its own ~2% for metadata): the owner may use nearly all of it
    assert vfs.f_bfree - vfs.f_bavail < vfs.f_blocks * 0.03
    assert homes.image_of(home).stat().st_blocks * 512 < 8 * MIB  # sparse until written
    options = next(line.split()[3] for line in Path("/proc/self/mounts").read_text().splitlines()
                   if line.split()[1] == str(home))
    assert {"nosuid", "nodev"} <= set(options.split(","))
    homes.mount(home, 32 * MIB, UID, GID)  # mounted already: left as it is
    assert Path("/proc/self/mounts").read_text().count(f" {home} ") == 1


def test_an_older_unbounded_home_moves_into_the_bounded_one(home: Path) -> None:
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "a.txt").write_text("my results")
    (home / "link").symlink_to("notes/a.txt")
    homes.mount(home, 32 * MIB, UID, GID)
    assert os.path.ismount(home)
    assert (home / "notes" / "a.txt").read_text() == "my results" and os.readlink(home / "link") == "notes/a.txt"
    assert {(p.lstat().st_uid, p.lstat().st_gid) for p in [home, *home.rglob("*")]} == {(UID, GID)}
    assert not home.with_name("wl_1.old").exists()


def test_an_older_home_that_does_not_fit_is_refused_and_release_removes_everything(home: Path) -> None:
    home.mkdir()
    (home / "big.bin").write_bytes(os.urandom(40 * MIB))
    with pytest.raises(OSError):
        homes.mount(home, 32 * MIB, UID, GID)
    homes.unmount(home)
    assert not os.path.ismount(home) and not homes.image_of(home).exists()
    assert not home.with_name("wl_1.old").exists()


def test_room_and_usage(home: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "f").write_bytes(b"x" * 3 * MIB)
    assert homes.room(plain) is None and 3 * MIB <= homes.usage(plain) < 4 * MIB
    homes.mount(home, 32 * MIB, UID, GID)
    before = homes.room(home)
    assert before is not None
    (home / "f").write_bytes(b"x" * 4 * MIB)
    os.sync()
    after = homes.room(home)
    assert after is not None and before - after >= 4 * MIB
