"""Owner storage: each owner's files under ``DATA_DIR/files/<owner-dir>/``, and what a name means.

An owner names files with relative POSIX paths of safe segments (``tiny/config.json``); a
"directory" is a path prefix, so a model is the files under one (``tiny/``). The bytes live on
disk at those paths, so a model directory can be mounted read-only into a sandbox as it is;
their metadata (size, sha256) lives in the store (table ``files``), which is the truth for
listings and the quota. The owner's directory is named by a hash of the owner id, never by
the id itself, so no owner id reaches a path.

``resolve`` turns what an owner wrote in ``model`` or ``image`` into a host path inside that
owner's storage, or inside a read-only root the operator shared (``shared/<root>/<path>``, from
the setting ``shared_models: {root: /host/path}``); the first segment ``shared`` is reserved
for this. Anything else, whatever the host holds, is :class:`NotFound` with ONE message: no
existence, permission, size or content oracle.

This module imports no store and no web framework: the API (``api/files.py``) keeps the
metadata in the same transaction as the rename that publishes an upload. At the top of the package: the API, the
controller, both drivers and the SDK's records (``FileList``, ``FileOut``) use it, and none of them owns the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from tensora.errors import TensoraError
from tensora.units import format_memory

MAX_NAME = 512
"""Characters in a whole name."""
MAX_SEGMENT_BYTES = 255
"""Bytes (UTF-8) in one segment: what Linux file systems allow in a file name."""
MAX_DEPTH = 32
SHARED = "shared"
"""The first segment that names an operator's shared root instead of the owner's files."""
NOT_FOUND = "not found in your files or the shared models"
UPLOAD_PREFIX = ".upload-"
"""Temp files of uploads in flight; no name can start with '.', so none can collide with a file."""


class StorageError(TensoraError):
    """Base of owner-storage errors."""


class BadName(StorageError):
    """A name that is not a relative path of safe segments (API: 422 naming it)."""


class NotFound(StorageError):
    """``resolve`` found nothing the owner may use; the message is always :data:`NOT_FOUND`."""

    def __init__(self) -> None:
        super().__init__(NOT_FOUND)


class OverQuota(StorageError):
    """An upload would take the owner past the storage quota (API: 413)."""

    def __init__(self, quota: int, used: int, in_flight: int = 0) -> None:
        self.quota, self.used, self.in_flight = quota, used, in_flight
        flight = f", {format_memory(in_flight)} by your uploads in flight" if in_flight else ""
        super().__init__(f"over your storage quota of {format_memory(quota)}: {format_memory(used)} is used by "
                         f"your other files{flight} (delete some with tensora files rm)")


class NameTaken(StorageError):
    """A file where a directory is (or the reverse): ``tiny`` and ``tiny/config.json`` (API: 409)."""


# -- names -----------------------------------------------------------------------------

def check_name(name: str, *, reserve_shared: bool = True) -> str:
    """``name`` if it is a relative POSIX path of safe segments, else BadName saying why.

    Refused: empty, absolute, longer than MAX_NAME, deeper than MAX_DEPTH, an empty segment
    (``a//b``, a trailing ``/``), a segment starting with ``.`` (``.``, ``..``, hidden names),
    a backslash, a control or other unprintable character (NUL, newline), a segment over 255
    bytes (lone surrogates are unprintable too), and, with ``reserve_shared``, ``shared/...`` (the
    operator's shared models).
    """
    if not isinstance(name, str) or not name:
        raise BadName("a file name must be a non-empty path such as tiny/model.safetensors")
    shown = repr(name[:80] + ("..." if len(name) > 80 else ""))
    if len(name) > MAX_NAME:
        raise BadName(f"{shown}: longer than {MAX_NAME} characters")
    if name.startswith("/"):
        raise BadName(f"{shown}: must be a relative path (no leading '/')")
    if not name.isprintable() or "\\" in name:
        raise BadName(f"{shown}: control characters and backslashes are not allowed")
    segments = name.split("/")
    if len(segments) > MAX_DEPTH:
        raise BadName(f"{shown}: deeper than {MAX_DEPTH} directories")
    for seg in segments:
        if not seg:
            raise BadName(f"{shown}: empty path segment ('//' or a trailing '/')")
        if seg.startswith("."):
            raise BadName(f"{shown}: segment {seg!r} starts with '.' ('.', '..' and hidden names are not allowed)")
        if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise BadName(f"{shown}: a segment is longer than {MAX_SEGMENT_BYTES} bytes")
    if reserve_shared and segments[0] == SHARED:
        raise BadName(f"{shown}: names under '{SHARED}/' are the operator's shared models")
    return name


def owner_dir(storage_root: Path, owner: str) -> Path:
    """The owner's directory: a hash of the owner id, so any id is a safe single segment."""
    return storage_root / hashlib.sha256(b"tensora-owner:" + owner.encode("utf-8")).hexdigest()[:32]


def parents_of(name: str) -> list[str]:
    """``a/b/c`` -> ``["a", "a/b"]``: the directories a file at ``name`` lives in."""
    segments = name.split("/")
    return ["/".join(segments[:i]) for i in range(1, len(segments))]


# -- resolution --------------------------------------------------------------------------

def resolve(owner: str, name: str, *, storage_root: Path, shared_roots: Mapping[str, Path]) -> Path:
    """The host path a ``model`` or ``image`` value names: a file or directory in the owner's
    storage, or ``shared/<root>[/<path>]`` inside an operator's shared root.

    Symlinks are resolved first (``Path.resolve(strict=True)``), then the result must lie inside
    the allowed root; a directory must hold only regular files and directories that stay inside
    it too (the validator and the sandbox read what they point to). Anything else raises
    NotFound, whose message is the same for every cause.
    """
    try:
        root, rel = _root_of(owner, name, storage_root, shared_roots)
        base = root.resolve(strict=True)
        found = (base / rel).resolve(strict=True) if rel else base
        if not found.is_relative_to(base):
            raise NotFound()
        mode = found.stat().st_mode
        if stat.S_ISDIR(mode):
            _check_tree(found, base)
        elif not stat.S_ISREG(mode):
            raise NotFound()
        return found
    except NotFound:
        raise
    except (OSError, RuntimeError, ValueError, BadName):  # missing, permission, a symlink loop, a bad name
        raise NotFound() from None


def _root_of(owner: str, name: str, storage_root: Path, shared_roots: Mapping[str, Path]) -> tuple[Path, str]:
    if not isinstance(name, str):
        raise NotFound()
    segments = name.split("/")
    if segments[0] == SHARED:
        if len(segments) < 2 or segments[1] not in shared_roots:
            raise NotFound()
        rel = "/".join(segments[2:])
        if rel:
            check_name(rel, reserve_shared=False)
        return Path(shared_roots[segments[1]]), rel
    return owner_dir(storage_root, owner), check_name(name)


def _check_tree(top: Path, base: Path) -> None:
    """Every entry under ``top``: a regular file or directory; a symlink must resolve inside ``base``
    to one of those (os.walk does not follow links, so a link to a directory is checked, not walked)."""
    for here, dirs, files in os.walk(top, onerror=_raise):
        for entry in (*dirs, *files):
            path = Path(here) / entry
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                target = path.resolve(strict=True)
                if not target.is_relative_to(base):
                    raise NotFound()
                mode = target.stat().st_mode
                if stat.S_ISDIR(mode):
                    _check_tree(target, base)
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise NotFound()


def _raise(exc: OSError) -> None:
    raise exc


# -- bytes on disk -----------------------------------------------------------------------

@dataclass
class Upload:
    """A temp file in the owner's directory, written chunk by chunk with its sha256 kept as it goes.
    ``abort()`` removes it; ``publish(dest)`` renames it over ``dest`` atomically."""

    tmp: Path
    fd: int
    size: int = 0
    _hash: hashlib._Hash = field(default_factory=hashlib.sha256)
    _closed: bool = False

    def write(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        view = memoryview(chunk)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.size += len(chunk)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def finish(self) -> None:
        """Flush to disk and close, before the rename makes it visible."""
        if not self._closed:
            os.fsync(self.fd)
            os.fchmod(self.fd, 0o644)
            os.close(self.fd)
            self._closed = True

    def abort(self) -> None:
        if not self._closed:
            os.close(self.fd)
            self._closed = True
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()

    def publish(self, dest: Path) -> None:
        """Rename into place (directories made as needed); NameTaken where a file blocks a directory
        or a directory blocks the file. The directory it lands in must resolve inside the one the
        temp file is in (the owner's), so a symlink planted there cannot redirect the write."""
        self.finish()
        top = self.tmp.parent.resolve(strict=True)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            if not dest.parent.resolve(strict=True).is_relative_to(top):
                raise NameTaken("the destination is not a plain path inside your storage")
            os.replace(self.tmp, dest)
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            raise NameTaken("a file and a directory of the same name cannot both exist") from None


@dataclass
class Storage:
    """Where owners' files live and the operator's shared read-only roots. How many bytes each owner may
    keep is its ``storage_bytes`` quota (``tensora.config.quotas``), which the API reads per owner."""

    root: Path
    shared: dict[str, Path] = field(default_factory=dict)

    def dir_of(self, owner: str) -> Path:
        return owner_dir(self.root, owner)

    def path_of(self, owner: str, name: str) -> Path:
        return self.dir_of(owner) / check_name(name)

    def begin(self, owner: str) -> Upload:
        """A fresh temp file in the owner's directory (0600 until published, never following a link)."""
        where = self.dir_of(owner)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        where.mkdir(exist_ok=True, mode=0o700)
        tmp = where / f"{UPLOAD_PREFIX}{secrets.token_hex(12)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return Upload(tmp, fd)

    def remove(self, owner: str, names: Iterable[str]) -> None:
        """Unlink the files and then every directory they leave empty (up to the owner's own)."""
        top = self.dir_of(owner)
        dirs: set[Path] = set()
        for name in names:
            path = self.path_of(owner, name)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            dirs.update(top / p for p in parents_of(name))
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty (other files), or gone
                d.rmdir()

    def sweep(self, owner: str, older_than_s: float, now: float) -> int:
        """Remove temp files of uploads that a crash left behind (untouched for ``older_than_s``)."""
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir_of(owner)):
                if entry.name.startswith(UPLOAD_PREFIX) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        if now - entry.stat(follow_symlinks=False).st_mtime > older_than_s:
                            os.unlink(entry.path)
                            removed += 1
        return removed

    def resolve(self, owner: str, name: str) -> Path:
        return resolve(owner, name, storage_root=self.root, shared_roots=self.shared)


# -- the API's shapes (the SDK parses them too; they import nothing of the server) -------------

class FileOut(BaseModel):
    path: str = Field(description="the name, a relative path such as tiny/model.safetensors")
    size: int = Field(description="bytes")
    sha256: str
    created_at: str = Field(description="when this content was uploaded (UTC, ISO 8601)")


class FileList(BaseModel):
    data: list[FileOut]
    used: int = Field(description="bytes the owner's files take (all of them, whatever the prefix)")
    quota: int = Field(description="the owner's storage quota, bytes")
