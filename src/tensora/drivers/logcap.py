"""A replica's log kept to a bound: cut back to nothing once it passes its cap, what it held last kept in one
rotated file beside it.

Writers hold these logs open (a replica's stdout, QEMU's serial console), always with ``O_APPEND``, so the
driver cuts them in place (copy, then truncate) on each observe, and the writer's next line lands at the start
of the file as it is then. Why not a pipe through a bounded writer: that writer would be one more process per
replica that must outlive ``tensora up`` as the sandbox does; a truncate needs none. The price: a log passes its
cap by what it writes between two observes (a second or two), and the lines written between the copy and the
truncate are lost.

A log may be in a dir its replica's uid writes (a VM's console in ``/vm``): it is opened without following a
link and without blocking on a FIFO, and cut only when it is a regular file of one link, so nothing planted
there redirects the truncate to another file; the rotated copy goes where the caller says (the replica's own
dir, which only Tensora enters).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

COPY_CHUNK = 1 << 20


def cap(log: Path, limit: int, rotated: Path) -> bool:
    """Cut ``log`` back to empty when it holds more than ``limit`` bytes, its last ``limit`` bytes (at most)
    first copied to ``rotated`` (replaced). True when it was cut. A missing log, or one that is not a plain
    file, is left as it is."""
    try:
        fd = os.open(log, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size <= limit:
            return False
        _copy_tail(fd, st.st_size, limit, rotated)
        os.ftruncate(fd, 0)
        return True
    finally:
        os.close(fd)


def _copy_tail(fd: int, size: int, limit: int, dest: Path) -> None:
    """The last ``limit`` bytes of ``fd`` (``size`` long) to ``dest``, 0600, by a rename: a reader never
    sees half of it."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(out, "wb") as f:
            offset = size - limit
            while offset < size:
                chunk = os.pread(fd, min(COPY_CHUNK, size - offset), offset)
                if not chunk:
                    break
                f.write(chunk)
                offset += len(chunk)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
