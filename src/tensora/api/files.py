"""Owner storage over HTTP: ``PUT /v1/files/{path}`` (a streamed upload), ``GET /v1/files``,
``DELETE /v1/files/{path}`` (a file, or every file of a directory).

An upload is written to a temp file in the owner's directory as it arrives (never whole in
memory), its sha256 computed on the way, then published by an atomic rename inside the store
transaction that records it. Its only size limit is the owner's remaining quota (the Guard
exempts these PUTs from the JSON body limit): a declared Content-Length over it is refused
before any byte is read, a streamed body as soon as it passes it, and a concurrent upload
that took the room in between at commit, where the owner's file writes take turns. Whatever
refuses it, the temp file is removed. Every key sees only its own owner's files: another
owner's path is simply not there.
"""

from __future__ import annotations

import errno
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from starlette.convertors import PathConvertor, register_url_convertor

from tensora.api import metrics, rates
from tensora.api.auth import Principal
from tensora.api.deps import ERRORS, RATED, Svc, caller, iso
from tensora.api.errors import ApiError
from tensora.api.owners import owner_settings
from tensora.api.services import Services
from tensora.storage import (
    BadName,
    FileList,
    FileOut,
    NameTaken,
    OverQuota,
    Storage,
    Upload,
    check_name,
    parents_of,
)
from tensora.store import repo

router = APIRouter(tags=["files"])


class _AnyPath(PathConvertor):
    """Starlette's ``path`` with newlines too (its ``.*`` stops at one), so that every name reaches
    ``check_name`` and a bad one is a 422 naming it, not a bare 404."""

    regex = r"[\s\S]*"


register_url_convertor("file_name", _AnyPath())

Reader = Annotated[Principal, Depends(caller("workloads:read"))]
Writer = Annotated[Principal, Depends(caller("workloads:write"))]

WRITE_BATCH = 1 << 20
"""Bytes gathered from the request before one write to disk (in a worker thread, with the hashing)."""
STALE_UPLOAD_S = 3600.0
"""A temp file untouched this long is a crashed upload's, removed when its owner next uploads."""

_BODY = {"requestBody": {"required": False, "description": "the file's bytes, streamed (none: an empty file)",
                         "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def _storage(svc: Services) -> Storage:
    if svc.storage is None:
        metrics.unavailable("storage")
        raise ApiError(503, "this server keeps no owner files (storage is not configured)",
                       headers={"X-Should-Retry": "false"})  # a setting, not a passing state
    return svc.storage


def _name(value: str, field: str = "path") -> str:
    try:
        return check_name(value)
    except BadName as exc:
        raise ApiError(422, str(exc), field=field) from None


def _out(f: repo.FileRow) -> dict[str, Any]:
    return {"path": f.path, "size": f.size, "sha256": f.sha256, "created_at": iso(f.created_at)}


@router.put("/v1/files/{path:file_name}", status_code=201, response_model=FileOut,
            responses={**RATED, 200: {"model": FileOut, "description": "replaced a file of that name"}},
            openapi_extra=_BODY, summary="Upload a file to your storage",
            description=("The body is the file's bytes (any size up to your remaining storage quota; 413 past "
                         "it). ``path`` is a relative name of safe segments, e.g. ``tiny/model.safetensors``: a "
                         "model is a directory of files. 201 for a new file, 200 when it replaced one. Name it "
                         "in ``model`` or ``image`` to use it."))
async def put_file(path: str, request: Request, svc: Svc, p: Writer) -> JSONResponse:
    name = _name(path)
    storage = _storage(svc)
    await run_in_threadpool(rates.take, svc, p.owner, rates.Action.UPLOAD)
    # 1. room: the quota less the owner's other files (a file replaced frees its own size)
    room, used, quota = await run_in_threadpool(_room, svc, storage, p.owner, name)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > room:
        raise _over(quota, used)
    # 2. stream the body to a temp file, hashing as it goes
    await run_in_threadpool(storage.sweep, p.owner, STALE_UPLOAD_S, time.time())
    upload = await run_in_threadpool(storage.begin, p.owner)
    try:
        pending = bytearray()
        async for chunk in request.stream():
            if upload.size + len(pending) + len(chunk) > room:
                raise _over(quota, used)
            pending += chunk
            if len(pending) >= WRITE_BATCH:
                await run_in_threadpool(upload.write, bytes(pending))
                pending.clear()
        if pending:
            await run_in_threadpool(upload.write, bytes(pending))
        await run_in_threadpool(upload.finish)
        # 3. record it and rename it into place, in one transaction
        row, replaced = await run_in_threadpool(_commit, svc, storage, p.owner, name, upload)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            metrics.unavailable("disk_full")
            raise ApiError(503, "the server's disk is full; retry later", retry_after=60) from None
        raise
    finally:
        upload.abort()  # after a publish there is nothing left to remove
    return JSONResponse(_out(row), status_code=200 if replaced else 201)


def _quota(conn: Any, svc: Services, owner: str) -> int:
    """The owner's ``storage_bytes`` quota: an admin's override, else the server's default."""
    return owner_settings(conn, svc, owner).quotas.storage_bytes


def _room(svc: Services, storage: Storage, owner: str, name: str) -> tuple[int, int, int]:
    """(bytes this upload may take, bytes the owner's other files take, its quota)."""
    with svc.db.read() as conn:
        old = repo.get_file(conn, owner, name)
        used = repo.storage_used(conn, owner) - (old.size if old else 0)
        quota = _quota(conn, svc, owner)
    return max(0, quota - used), used, quota


def _over(quota: int, used: int) -> ApiError:
    return ApiError(413, str(OverQuota(quota, used)))


def _commit(svc: Services, storage: Storage, owner: str, name: str, upload: Upload) -> tuple[repo.FileRow, bool]:
    with svc.db.write() as conn:
        repo.lock_owner_files(conn, owner)
        blocker = repo.blocking_file(conn, owner, name, parents_of(name))
        if blocker is not None:
            raise ApiError(409, f"{name!r} is a directory (it holds {blocker!r}): delete it first"
                           if blocker.startswith(name + "/") else
                           f"{blocker!r} is a file, so {name!r} cannot be inside it", field="path")
        old = repo.get_file(conn, owner, name)
        used = repo.storage_used(conn, owner) - (old.size if old else 0)
        quota = _quota(conn, svc, owner)  # as of now: an admin may have lowered it during the upload
        if used + upload.size > quota:
            raise _over(quota, used)
        row = repo.FileRow(owner, name, upload.size, upload.sha256, svc.clock.now())
        replaced = repo.put_file(conn, row)
        try:
            upload.publish(storage.path_of(owner, name))  # last: a failure here rolls the row back
        except NameTaken as exc:
            raise ApiError(409, f"{name!r}: {exc}", field="path") from None
    return row, replaced


@router.get("/v1/files", response_model=FileList, responses=ERRORS,
            summary="Your files", description="Every file of your storage by path (or those under ``prefix``), "
                                              "with the bytes they take and your quota.")
def list_files(svc: Svc, p: Reader,
               prefix: Annotated[str | None, Query(max_length=512, description="a file or directory name")] = None,
               ) -> dict[str, Any]:
    _storage(svc)  # 503 where this server keeps no files
    if prefix is not None:
        _name(prefix, "prefix")
    with svc.db.read() as conn:
        files = repo.list_files(conn, p.owner, prefix)
        used = repo.storage_used(conn, p.owner)
        quota = _quota(conn, svc, p.owner)
    return {"data": [_out(f) for f in files], "used": used, "quota": quota}


@router.delete("/v1/files/{path:file_name}", response_model=FileList, responses=ERRORS,
               summary="Delete a file, or a directory's files",
               description="Deletes the file named ``path``, or every file under ``path/`` (a model directory); "
                           "answers with what was deleted and the room left.")
def delete_file(path: str, svc: Svc, p: Writer) -> dict[str, Any]:
    name = _name(path)
    storage = _storage(svc)
    with svc.db.write() as conn:
        repo.lock_owner_files(conn, p.owner)
        files = repo.list_files(conn, p.owner, name)
        if not files:
            raise ApiError(404, f"no file or directory {name!r} in your files")
        repo.delete_files(conn, p.owner, [f.path for f in files])
        storage.remove(p.owner, [f.path for f in files])
        used = repo.storage_used(conn, p.owner)
        quota = _quota(conn, svc, p.owner)
    return {"data": [_out(f) for f in files], "used": used, "quota": quota}
