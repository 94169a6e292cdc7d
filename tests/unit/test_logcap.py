"""``drivers.logcap``: a log past its cap is cut back in place, its last bytes kept in one rotated file;
anything that is not a plain file of one link is left alone (a link planted in a VM's dir would otherwise
turn the driver's truncate on a file of the host)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tensora.drivers.logcap import cap

LIMIT = 1000


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], None]
    """Makes ``log`` (and what else the case needs) in the dir."""
    cut: bool
    log_after: bytes | None
    rotated: bytes | None


def write(data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / "log").write_bytes(data)


def link_to_victim(d: Path) -> None:
    (d / "victim").write_bytes(b"v" * 5000)
    (d / "log").symlink_to(d / "victim")


def hard_link(d: Path) -> None:
    (d / "victim").write_bytes(b"v" * 5000)
    os.link(d / "victim", d / "log")


CASES = {
    "under the cap -> left as it is": Case(write(b"a" * LIMIT), False, b"a" * LIMIT, None),
    "past the cap -> emptied, its last LIMIT bytes rotated": Case(
        write(b"a" * 3000 + b"b" * LIMIT), True, b"", b"b" * LIMIT),
    "no log -> nothing": Case(lambda d: None, False, None, None),
    "a symlink to another file -> left alone, the target intact": Case(link_to_victim, False, b"v" * 5000, None),
    "a hard link to another file -> left alone": Case(hard_link, False, b"v" * 5000, None),
    "a FIFO -> left alone, not blocked on": Case(lambda d: os.mkfifo(d / "log"), False, None, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cap(case: Case, tmp_path: Path) -> None:
    case.make(tmp_path)
    assert cap(tmp_path / "log", LIMIT, tmp_path / "log.1") is case.cut
    if case.log_after is not None:
        assert (tmp_path / "log").read_bytes() == case.log_after
    if (tmp_path / "victim").exists():
        assert (tmp_path / "victim").read_bytes() == b"v" * 5000
    rotated = tmp_path / "log.1"
    assert (rotated.read_bytes() if rotated.exists() else None) == case.rotated
    if case.rotated is not None:
        assert rotated.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_writer_appending_goes_on_from_the_start_after_a_cut(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with open(log, "ab", buffering=0) as writer:  # as runc and QEMU hold it: O_APPEND
        writer.write(b"x" * 5000)
        assert cap(log, LIMIT, tmp_path / "log.1")
        writer.write(b"next line\n")
    assert log.read_bytes() == b"next line\n"
