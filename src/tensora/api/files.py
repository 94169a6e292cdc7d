"""Owner storage over HTTP: ``PUT /v1/files/{path}`` (a streamed upload), ``GET /v1/files``,
``DELETE /v1/files/{path}`` (a file, or every file of a directory).

An upload is written to a temp file in the owner's directory as it arrives (never whole in
memory), its sha256 computed on the way, then published by an atomic rename inside the store
transaction that records it. Its only size limit is the owner's remaining quota (the Guard
exempts these PUTs from the JSON body limit).

Uploads in flight count against the quota: each holds a reservation in the store
(``upload_reservations``, so every API worker sees it), its declared Content-Length at once, or
for a chunked body what it received so far (held ahead a step at a time). Room is the quota less
the owner's files and the other uploads' reservations, checked where the owner's file writes take
turns, so the files stored plus the bytes in flight never pass the quota: a declared length over
the room is refused before any byte is read, a chunked body as soon as it passes it, each with the
quota's 413. A reservation goes with its upload (published or refused) and expires when a crashed
worker leaves it (renewed while bytes arrive). Whatever refuses it, the temp file is removed. Every
key sees only its own owner's files: another owner's path is simply not there.
"""

from __future__ import annotations

import errno
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from starlette.convertors import PathConvertor, register_url_convertor

from tensora.api import metrics, rates
from tensora.api.deps import ERRORS, RATED, Svc, caller, iso
from tensora.api.errors import ApiError
from tensora.api.owners import owner_settings
from tensora.api.principal import Principal
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
from tensora.store import files as files_repo

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
RESERVATION_TTL_S = 300.0
"""An upload's reservation lasts this long unless renewed: a crashed worker's stops counting after it."""
RENEW_S = 60.0
"""An upload in flight renews its reservation this often while its bytes arrive."""
RESERVE_STEP = WRITE_BATCH
"""A chunked upload holds this much ahead of what it received (one store write per step)."""

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


def _out(f: files_repo.FileRow) -> dict[str, Any]:
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
    # 1. room, held: its declared length at once (refused before a byte is read), or a first step
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    ticket = secrets.token_hex(16)
    held = await run_in_threadpool(_reserve, svc, p.owner, name, ticket, declared or 0,
                                   RESERVE_STEP if declared is None else declared)
    renewed = time.monotonic()
    upload = None
    try:
        # 2. stream the body to a temp file, hashing as it goes, holding what it takes
        await run_in_threadpool(storage.sweep, p.owner, STALE_UPLOAD_S, time.time())
        upload = await run_in_threadpool(storage.begin, p.owner)
        pending = bytearray()
        async for chunk in request.stream():
            need = upload.size + len(pending) + len(chunk)
            if need > held or time.monotonic() - renewed > RENEW_S:
                held = await run_in_threadpool(_reserve, svc, p.owner, name, ticket, need,
                                               max(held, need + RESERVE_STEP))
                renewed = time.monotonic()
            pending += chunk
            if len(pending) >= WRITE_BATCH:
                await run_in_threadpool(upload.write, bytes(pending))
                pending.clear()
        if pending:
            await run_in_threadpool(upload.write, bytes(pending))
        await run_in_threadpool(upload.finish)
        # 3. record it and rename it into place, in one transaction
        row, replaced = await run_in_threadpool(_commit, svc, storage, p.owner, name, upload, ticket)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            metrics.unavailable("disk_full")
            raise ApiError(503, "the server's disk is full; retry later", retry_after=60) from None
        raise
    finally:
        if upload is not None:
            upload.abort()  # after a publish there is nothing left to remove
        await run_in_threadpool(_unreserve, svc, ticket)  # gone with the row already, once published
    return JSONResponse(_out(row), status_code=200 if replaced else 201)


def _quota(conn: Any, svc: Services, owner: str) -> int:
    """The owner's ``storage_bytes`` quota: an admin's override, else the server's default."""
    return owner_settings(conn, svc, owner).quotas.storage_bytes


def _reserve(svc: Services, owner: str, name: str, ticket: str, need: int, want: int) -> int:
    """Hold ``want`` bytes of the owner's quota for upload ``ticket`` (less where less is free, never less
    than ``need``, else the quota's 413): the quota less the owner's other files (a file replaced frees its
    own size) and the other uploads in flight. Returns the bytes held."""
    now = svc.clock.now()
    with svc.db.write() as conn:
        files_repo.lock_owner_files(conn, owner)  # the check and the hold are one step for every worker
        old = files_repo.get_file(conn, owner, name)
        used = files_repo.storage_used(conn, owner) - (old.size if old else 0)
        others = files_repo.reserved(conn, owner, now, besides=ticket)
        quota = _quota(conn, svc, owner)
        room = quota - used - others
        if need > room:  # refused: what it held goes at once, in this step, so a rival can go on
            files_repo.unreserve(conn, ticket)
        else:
            files_repo.reserve(conn, ticket, owner, min(want, room), now, RESERVATION_TTL_S)
    if need > room:
        raise _over(quota, used, others)
    return min(want, room)


def _unreserve(svc: Services, ticket: str) -> None:
    with svc.db.write() as conn:
        files_repo.unreserve(conn, ticket)


def _over(quota: int, used: int, in_flight: int = 0) -> ApiError:
    return ApiError(413, str(OverQuota(quota, used, in_flight)))


def _commit(svc: Services, storage: Storage, owner: str, name: str, upload: Upload,
            ticket: str) -> tuple[files_repo.FileRow, bool]:
    with svc.db.write() as conn:
        files_repo.lock_owner_files(conn, owner)
        blocker = files_repo.blocking_file(conn, owner, name, parents_of(name))
        if blocker is not None:
            raise ApiError(409, f"{name!r} is a directory (it holds {blocker!r}): delete it first"
                           if blocker.startswith(name + "/") else
                           f"{blocker!r} is a file, so {name!r} cannot be inside it", field="path")
        old = files_repo.get_file(conn, owner, name)
        used = files_repo.storage_used(conn, owner) - (old.size if old else 0)
        others = files_repo.reserved(conn, owner, svc.clock.now(), besides=ticket)
        quota = _quota(conn, svc, owner)  # as of now: an admin may have lowered it during the upload
        if used + others + upload.size > quota:
            raise _over(quota, used, others)
        row = files_repo.FileRow(owner, name, upload.size, upload.sha256, svc.clock.now())
        replaced = files_repo.put_file(conn, row)
        files_repo.unreserve(conn, ticket)  # its bytes now count as a file, in the same step
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
        files = files_repo.list_files(conn, p.owner, prefix)
        used = files_repo.storage_used(conn, p.owner)
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
        files_repo.lock_owner_files(conn, p.owner)
        files = files_repo.list_files(conn, p.owner, name)
        if not files:
            raise ApiError(404, f"no file or directory {name!r} in your files")
        files_repo.delete_files(conn, p.owner, [f.path for f in files])
        storage.remove(p.owner, [f.path for f in files])
        used = files_repo.storage_used(conn, p.owner)
        quota = _quota(conn, svc, p.owner)
    return {"data": [_out(f) for f in files], "used": used, "quota": quota}
