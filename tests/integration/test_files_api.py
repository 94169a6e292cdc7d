"""Owner storage over real HTTP (uvicorn on loopback, httpx), on SQLite and PostgreSQL: streamed
uploads past the 1 MiB JSON body limit with their sha256, listings that show only the caller's
files, deletes of a file or a model directory, names that try to leave the owner's storage
(422 naming them, nothing written), the quota (413 naming it, nothing half-written, also for two
uploads at once), and the CLI uploading a model directory, then listing it."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.config.quotas import OwnerSettings, Quotas
from tensora.models.validator import read_model
from tensora.sdk import Client, UnprocessableError
from tensora.storage import NOT_FOUND, NotFound, Storage, owner_dir
from tensora.store import files as files_repo
from tests.support import services
from tests.support.api import tiny_model
from tests.support.stack import Stack, stack

MiB = 2**20


@dataclass
class Files:
    stack: Stack
    url: str
    storage: Storage
    tmp: Path

    def as_(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.stack.headers(key), timeout=30)

    def on_disk(self, owner: str) -> list[str]:
        """Every entry under the owner's directory, relative, temp files included."""
        top = owner_dir(self.storage.root, owner)
        return sorted(p.relative_to(top).as_posix() for p in top.rglob("*")) if top.exists() else []


@pytest.fixture
def files(db_url: str, tmp_path: Path) -> Iterator[Files]:
    s = stack(db_url, tmp_path, run_controller=False)
    storage = Storage(tmp_path / "files", shared={"pool": tmp_path / "pool"})
    s.services.storage = storage
    s.services.owner_defaults = OwnerSettings(quotas=Quotas(storage_bytes=8 * MiB))  # every owner's, small
    with services.serving(s.app) as live:
        try:
            yield Files(s, live.url, storage, tmp_path)
        finally:
            s.services.db.dispose()


def enc(name: str) -> str:
    """Every byte but letters and digits percent-encoded, so the client normalizes nothing ('..')."""
    return "".join(chr(b) if chr(b).isalnum() else f"%{b:02X}" for b in name.encode("utf-8", "surrogatepass"))


def blob(n: int, seed: int = 1) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (n // 32 + 1))[:n]


def test_a_multi_mib_upload_streams_past_the_body_limit_and_reads_back(files: Files) -> None:
    body = blob(3 * MiB + 17)
    with files.as_(files.stack.alice) as alice:
        r = alice.put("/v1/files/big/weights.bin", content=body)
        assert r.status_code == 201, r.text
        assert r.json() | {"created_at": None} == {"path": "big/weights.bin", "size": len(body),
                                                   "sha256": hashlib.sha256(body).hexdigest(), "created_at": None}
        # chunked (no Content-Length): the Guard neither buffers nor limits it
        other = blob(2 * MiB, seed=2)
        r = alice.put("/v1/files/big/chunked.bin", content=iter([other[i:i + 65536]
                                                                 for i in range(0, len(other), 65536)]))
        assert r.status_code == 201, r.text
        assert r.json()["sha256"] == hashlib.sha256(other).hexdigest()
        listing = alice.get("/v1/files").json()
    assert [(f["path"], f["size"]) for f in listing["data"]] == [("big/chunked.bin", 2 * MiB),
                                                                 ("big/weights.bin", len(body))]
    assert (listing["used"], listing["quota"]) == (len(body) + 2 * MiB, 8 * MiB)
    assert files.storage.path_of("alice", "big/weights.bin").read_bytes() == body
    assert files.on_disk("alice") == ["big", "big/chunked.bin", "big/weights.bin"]  # no temp file left


def test_putting_a_name_again_replaces_it(files: Files) -> None:
    with files.as_(files.stack.alice) as alice:
        assert alice.put("/v1/files/notes.txt", content=b"one").status_code == 201
        r = alice.put("/v1/files/notes.txt", content=b"two!")
        assert r.status_code == 200 and r.json()["size"] == 4
        assert [f["size"] for f in alice.get("/v1/files").json()["data"]] == [4]
    assert files.storage.path_of("alice", "notes.txt").read_bytes() == b"two!"


def test_owners_see_only_their_own_files(files: Files) -> None:
    with files.as_(files.stack.alice) as alice, files.as_(files.stack.bob) as bob, \
            files.as_(files.stack.admin) as admin:
        assert alice.put("/v1/files/tiny/model.safetensors", content=b"x").status_code == 201
        assert bob.put("/v1/files/mine.bin", content=b"y").status_code == 201
        assert [f["path"] for f in alice.get("/v1/files").json()["data"]] == ["tiny/model.safetensors"]
        assert [f["path"] for f in bob.get("/v1/files").json()["data"]] == ["mine.bin"]
        assert admin.get("/v1/files").json()["data"] == []  # keys see their own owner's files, admins too
        r = bob.delete("/v1/files/tiny/model.safetensors")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no file or directory " \
                                                                       "'tiny/model.safetensors' in your files"
        assert bob.delete("/v1/files/tiny").status_code == 404
        assert [f["path"] for f in alice.get("/v1/files").json()["data"]] == ["tiny/model.safetensors"]
    with pytest.raises(NotFound, match=f"^{re.escape(NOT_FOUND)}$"):
        files.storage.resolve("bob", "tiny/model.safetensors")


def test_delete_a_file_or_a_whole_directory(files: Files) -> None:
    with files.as_(files.stack.alice) as alice:
        for name in ("tiny/config.json", "tiny/model.safetensors", "tiny/sub/extra.bin", "tinyx", "disk.qcow2"):
            assert alice.put(f"/v1/files/{name}", content=name.encode()).status_code == 201
        r = alice.delete("/v1/files/disk.qcow2")
        assert r.status_code == 200 and [f["path"] for f in r.json()["data"]] == ["disk.qcow2"]
        r = alice.delete("/v1/files/tiny")
        assert [f["path"] for f in r.json()["data"]] == ["tiny/config.json", "tiny/model.safetensors",
                                                         "tiny/sub/extra.bin"]
        assert r.json()["used"] == len("tinyx")
        assert [f["path"] for f in alice.get("/v1/files").json()["data"]] == ["tinyx"]
        assert alice.delete("/v1/files/tiny").status_code == 404
    assert files.on_disk("alice") == ["tinyx"]  # the emptied directories went too


def test_a_directory_name_is_a_prefix_not_a_pattern(files: Files) -> None:
    with files.as_(files.stack.alice) as alice:
        for name in ("a_b/1", "axb/1", "a%b/1", "a%bc/1"):
            assert alice.put("/v1/files/" + enc(name), content=b"x").status_code == 201
        assert [f["path"] for f in alice.delete("/v1/files/" + enc("a_b")).json()["data"]] == ["a_b/1"]
        assert [f["path"] for f in alice.delete("/v1/files/" + enc("a%b")).json()["data"]] == ["a%b/1"]
        assert [f["path"] for f in alice.get("/v1/files").json()["data"]] == ["a%bc/1", "axb/1"]


def test_names_are_exact_not_case_insensitive(files: Files) -> None:
    """``OK`` and ``ok`` are two names: deleting, listing or writing one never reaches the other's files."""
    with files.as_(files.stack.alice) as alice:
        for name in ("OK", "ok/a.bin", "ok/b.bin", "Ok/c.bin"):
            assert alice.put(f"/v1/files/{name}", content=b"x").status_code == 201, name
        assert alice.put("/v1/files/OK", content=b"OK again, beside the directory ok").status_code == 200
        assert [f["path"] for f in alice.get("/v1/files", params={"prefix": "OK"}).json()["data"]] == ["OK"]
        r = alice.delete("/v1/files/OK")
        assert r.status_code == 200 and [f["path"] for f in r.json()["data"]] == ["OK"]
        assert alice.delete("/v1/files/OK").status_code == 404
        assert alice.delete("/v1/files/oK").status_code == 404
        assert [f["path"] for f in alice.get("/v1/files").json()["data"]] == ["Ok/c.bin", "ok/a.bin", "ok/b.bin"]
    assert files.on_disk("alice") == ["Ok", "Ok/c.bin", "ok", "ok/a.bin", "ok/b.bin"]


def test_a_file_and_a_directory_cannot_share_a_name(files: Files) -> None:
    with files.as_(files.stack.alice) as alice:
        assert alice.put("/v1/files/tiny", content=b"a file").status_code == 201
        r = alice.put("/v1/files/tiny/config.json", content=b"{}")
        assert (r.status_code, r.json()["error"]["message"]) == (
            409, "'tiny' is a file, so 'tiny/config.json' cannot be inside it")
        assert alice.put("/v1/files/model/config.json", content=b"{}").status_code == 201
        r = alice.put("/v1/files/model", content=b"x")
        assert (r.status_code, r.json()["error"]["message"]) == (
            409, "'model' is a directory (it holds 'model/config.json'): delete it first")
    assert files.on_disk("alice") == ["model", "model/config.json", "tiny"]


TRAVERSAL = {
    "parent": "..",
    "parent then a name": "../x",
    "out of the owner's dir to another owner": "../{bob}/secret.bin",
    "deep traversal": "a/../../../etc/passwd",
    "absolute": "/etc/shadow",
    "dot": "./a",
    "dot segment": "a/./b",
    "hidden": ".upload-0123",
    "empty segment": "a//b",
    "trailing slash": "tiny/",
    "NUL": "a\x00b",
    "newline": "a\nb",
    "backslash": "..\\x",
    "too long": "x" * 600,
    "the shared namespace": "shared/pool/x",
}


@pytest.mark.parametrize("name", TRAVERSAL.values(), ids=TRAVERSAL.keys())
def test_names_that_leave_the_owners_storage_are_422_naming_the_path(files: Files, name: str) -> None:
    name = name.format(bob=owner_dir(files.storage.root, "bob").name)
    with files.as_(files.stack.alice) as alice:
        for method in ("PUT", "DELETE"):
            r = alice.request(method, "/v1/files/" + enc(name), content=b"x" if method == "PUT" else None)
            assert r.status_code == 422, (method, r.text)
            error = r.json()["error"]
            assert error["field"] == "path" and repr(name[:80])[:30] in error["message"], error
        assert alice.get("/v1/files").json()["data"] == []
    assert not files.storage.root.exists() or files.on_disk("alice") == []
    assert sorted(p.name for p in files.tmp.iterdir() if p.name not in ("tensora.db", "tensora.db-wal",
                  "tensora.db-shm", "tensora.db.write-lock", "files")) == []  # nothing written beside


def test_over_quota_is_413_naming_it_and_leaves_nothing_half_written(files: Files) -> None:
    with files.as_(files.stack.alice) as alice:
        assert alice.put("/v1/files/a.bin", content=blob(5 * MiB)).status_code == 201
        # declared too big: refused before a byte is read
        r = alice.put("/v1/files/b.bin", content=blob(4 * MiB))
        assert r.status_code == 413, r.text
        assert r.json()["error"]["message"] == ("over your storage quota of 8Mi: 5Mi is used by your other "
                                                "files (delete some with tensora files rm)")
        # streamed (no Content-Length): refused as it passes the room left
        r = alice.put("/v1/files/b.bin", content=iter([blob(MiB)] * 4))
        assert r.status_code == 413 and "quota of 8Mi" in r.json()["error"]["message"]
        # replacing a file frees its own size first: 5 MiB -> 8 MiB fits exactly
        assert alice.put("/v1/files/a.bin", content=blob(8 * MiB)).status_code == 200
        listing = alice.get("/v1/files").json()
    assert [(f["path"], f["size"]) for f in listing["data"]] == [("a.bin", 8 * MiB)]
    assert files.on_disk("alice") == ["a.bin"]  # no temp file, no b.bin


def test_two_uploads_at_once_cannot_both_take_the_last_room(files: Files) -> None:
    """Both pass the first check (nothing used yet) and stream; at commit the owner's writes take
    turns, so the second sees the first's 5 MiB and is refused."""
    codes: list[int] = []
    start = threading.Barrier(2)

    def upload(name: str) -> None:
        with files.as_(files.stack.alice) as alice:
            start.wait()
            codes.append(alice.put(f"/v1/files/{name}", content=iter([blob(MiB)] * 5)).status_code)

    threads = [threading.Thread(target=upload, args=(n,)) for n in ("one.bin", "two.bin")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(codes) == [201, 413]
    with files.as_(files.stack.alice) as alice:
        assert alice.get("/v1/files").json()["used"] == 5 * MiB
    assert len(files.on_disk("alice")) == 1


def in_flight(files: Files, owner: str) -> int:
    """Bytes the owner's uploads in flight have on disk now (their temp files; one that ends between the listing
    and its size counts nothing)."""
    top = owner_dir(files.storage.root, owner)
    total = 0
    for p in top.glob(".upload-*") if top.exists() else ():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


class HeldUpload:
    """An upload over a raw socket, as a client that reads an early answer would send it: its headers (with
    a Content-Length, or chunked), then its body in 64 KiB pieces, looking for the server's answer before
    each; it stops half way until told to go on."""

    def __init__(self, files: Files, name: str, size: int, *, declared: bool) -> None:
        host, port = files.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.size, self.declared, self.sent = size, declared, 0
        self.answer: tuple[int, str] | None = None
        framing = f"Content-Length: {size}" if declared else "Transfer-Encoding: chunked"
        auth = files.stack.headers(files.stack.alice)
        head = "".join(f"{k}: {v}\r\n" for k, v in auth.items())
        self.sock.sendall(f"PUT /v1/files/{name} HTTP/1.1\r\nHost: {host}\r\n{head}{framing}\r\n"
                          "Connection: close\r\n\r\n".encode())

    def send(self, upto: int) -> None:
        """Body bytes up to ``upto`` (all sent: the chunked terminator too), unless the server answered."""
        while self.answer is None and self.sent < upto:
            if select.select([self.sock], [], [], 0)[0]:
                self.read()
                return
            piece = blob(min(64 * 1024, upto - self.sent), seed=self.sent)
            try:
                self.sock.sendall(piece if self.declared else b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:  # closed after its answer: read it
                self.read()
                return
            self.sent += len(piece)
        if self.answer is None and self.sent == self.size and not self.declared:
            self.sock.sendall(b"0\r\n\r\n")

    def read(self) -> tuple[int, str]:
        if self.answer is None:
            response = http.client.HTTPResponse(self.sock)
            try:
                response.begin()
                self.answer = (response.status, response.read().decode())
            except OSError as exc:
                self.answer = (0, f"no answer: {exc!r}")
            self.sock.close()
        return self.answer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("declared", [True, False], ids=["with Content-Length", "chunked"])
def test_uploads_in_flight_count_against_the_quota(files: Files, declared: bool) -> None:
    """The attack: five uploads at once, each within the quota, each stopped half way with its connection
    open; all five were let in, and together they put several times the quota on disk. Each upload holds
    its bytes of the quota while in flight (its Content-Length at once; chunked, as they arrive), in the
    store: what no longer fits is refused with the quota's 413 (a declared length before its body is read),
    and the disk never holds more than the quota."""
    size, first = 5 * MiB, 4 * MiB
    uploads = [HeldUpload(files, f"u{i}.bin", size, declared=declared) for i in range(5)]
    threads = [threading.Thread(target=u.send, args=(first,)) for u in uploads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # what the server took in is written as it comes: the peak on disk while all five are stopped
    peak, last, still = 0, -1, 0
    for _ in range(200):
        now = in_flight(files, "alice")
        peak = max(peak, now)
        still = still + 1 if now == last else 0
        if still >= 10 or peak > 8 * MiB:
            break
        last = now
        time.sleep(0.05)
    threads = [threading.Thread(target=u.send, args=(size,)) for u in uploads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    answers = [u.read() for u in uploads]
    assert peak <= 8 * MiB, f"{peak / MiB:.1f} MiB on disk under an 8 MiB quota: {answers}"
    stored = [a for a in answers if a[0] == 201]
    refused = [a for a in answers if a[0] != 201]
    # two of 5 MiB never fit in 8 MiB; chunked ones that all grow at once may all meet the wall
    assert len(stored) == 1 if declared else len(stored) <= 1, answers
    assert all(code in (413, 0) for code, _ in refused), answers
    assert all("over your storage quota of 8Mi" in text for code, text in refused if code == 413), answers
    if declared:  # refused before its body: every one of them read its answer
        assert [code for code, _ in refused] == [413] * 4, answers
    with files.as_(files.stack.alice) as alice:
        assert alice.get("/v1/files").json()["used"] == len(stored) * size
    assert len(files.on_disk("alice")) == len(stored)
    with files.stack.services.db.read() as conn:  # every reservation went with its upload
        assert files_repo.reserved(conn, "alice", 0.0) == 0


def test_an_uploaded_model_resolves_and_is_sized_by_the_validator(files: Files) -> None:
    model, params = tiny_model(files.tmp)
    with files.as_(files.stack.alice) as alice:
        assert alice.put("/v1/files/tiny/model.safetensors", content=model.read_bytes()).status_code == 201
    where = files.storage.resolve("alice", "tiny")
    assert where == owner_dir(files.storage.root, "alice").resolve() / "tiny"
    assert read_model(where).params == params


def test_without_storage_the_routes_say_so(files: Files) -> None:
    files.stack.services.storage = None
    with files.as_(files.stack.alice) as alice:
        r = alice.get("/v1/files")
    assert r.status_code == 503 and r.headers["x-should-retry"] == "false"
    assert "storage is not configured" in r.json()["error"]["message"]


def test_a_read_only_key_cannot_upload(files: Files) -> None:
    with files.as_(files.stack.alice) as alice:
        key = alice.post("/v1/keys", json={"name": "ro", "scopes": ["workloads:read"]}).json()["key"]
    with files.as_(key) as ro:
        r = ro.put("/v1/files/x", content=b"x")
        assert r.status_code == 403 and "workloads:write" in r.json()["error"]["message"]
        assert ro.get("/v1/files").status_code == 200


# -- the CLI -----------------------------------------------------------------------------

def cli(files: Files, *args: str, columns: int = 200) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORA_")}
    env.update({"TENSORA_API_URL": files.url, "TENSORA_API_KEY": files.stack.alice,
                "TENSORA_CONFIG": str(files.tmp / "profiles.json"), "COLUMNS": str(columns)})
    r = subprocess.run([sys.executable, "-m", "tensora.cli", *args], capture_output=True, text=True, env=env,
                       timeout=120, cwd=files.tmp)
    assert r.returncode == 0, f"{args} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_cli_uploads_a_model_directory_then_lists_and_removes_it(files: Files) -> None:
    local = files.tmp / "tiny-model"
    (local / "sub").mkdir(parents=True)
    (local / ".git").mkdir()
    (local / ".git" / "HEAD").write_text("ref")
    (local / "config.json").write_text('{"a": 1}')
    weights = blob(2 * MiB + 5)
    (local / "model.safetensors").write_bytes(weights)
    (local / "sub" / "tokenizer.json").write_text("{}")
    r = cli(files, "files", "upload", str(local), "tiny")
    assert "uploaded 3 files, 2.0Mi, as tiny" in r.stderr
    listing: dict[str, Any] = json.loads(cli(files, "files", "list", "-o", "json").stdout)
    assert [(f["path"], f["size"]) for f in listing["data"]] == [
        ("tiny/config.json", 8), ("tiny/model.safetensors", len(weights)), ("tiny/sub/tokenizer.json", 2)]
    assert listing["data"][1]["sha256"] == hashlib.sha256(weights).hexdigest()
    for columns in (100, 40):  # each path whole on one line, never wrapped or cut, even when narrow
        table = cli(files, "files", "list", columns=columns).stdout
        for f in listing["data"]:
            assert any(f["path"] in line and f["sha256"][:12] in line and " 2.0Mi " in table
                       for line in table.splitlines()), table
        assert all(line == line.rstrip() for line in table.splitlines()), table  # no trailing spaces
    assert "removed 3 files" in cli(files, "files", "rm", "tiny").stdout
    assert json.loads(cli(files, "files", "list", "-o", "json").stdout)["data"] == []


# -- the SDK -----------------------------------------------------------------------------

def test_sdk_uploads_a_directory_with_progress_lists_and_deletes(files: Files) -> None:
    local = files.tmp / "m"
    (local / "sub").mkdir(parents=True)
    (local / ".cache").mkdir()
    (local / ".cache" / "x").write_text("left out")
    (local / "model.safetensors").write_bytes(blob(MiB + 3))
    (local / "sub" / "a.json").write_text("{}")
    (local / "linked.json").symlink_to(local / "sub" / "a.json")  # a link to a file is sent as the file
    seen: list[int] = []
    with Client(files.stack.alice, files.url) as c:
        up = c.upload_dir(local, "tiny", on_progress=seen.append)
        assert [(f.path, f.size) for f in up] == [("tiny/linked.json", 2), ("tiny/model.safetensors", MiB + 3),
                                                  ("tiny/sub/a.json", 2)]
        assert seen == sorted(seen) and seen[-1] == MiB + 7
        assert c.upload_file(local / "sub" / "a.json", "other.json").path == "other.json"
        assert [f.path for f in c.list_files("tiny/sub").data] == ["tiny/sub/a.json"]
        assert c.list_files().used == MiB + 9
        with pytest.raises(UnprocessableError, match=r"'\.\./x': segment '\.\.'") as bad:
            c.upload_file(local / "sub" / "a.json", "../x")
        assert bad.value.body["error"]["field"] == "path"
        assert [f.path for f in c.delete_file("tiny").data] == [f.path for f in up]
        assert [f.path for f in c.list_files().data] == ["other.json"]


def test_a_retried_upload_sends_the_whole_file_again(tmp_path: Path) -> None:
    data = blob(3 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.read())
        if len(bodies) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})
        return httpx.Response(201, json={"path": "f.bin", "size": len(bodies[-1]), "created_at": "x",
                                         "sha256": hashlib.sha256(bodies[-1]).hexdigest()})

    with Client("tsk_x", "http://api", transport=httpx.MockTransport(handler), sleep=lambda _: None) as c:
        out = c.upload_file(tmp_path / "f.bin", "f.bin")
    assert [len(b) for b in bodies] == [len(data), len(data)] and bodies[1] == data
    assert out.sha256 == hashlib.sha256(data).hexdigest()
