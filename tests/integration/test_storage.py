"""Owner storage without HTTP: which names are files' names, what ``resolve`` lets an owner name
(one message for everything else, whatever the host holds), and per-owner sandbox uids in the
store (SQLite and PostgreSQL): stable, distinct, race-safe, never 0 or Tensora's own."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tensora.storage import NOT_FOUND, BadName, NotFound, Storage, check_name, owner_dir, resolve
from tensora.store import uids as uids_repo
from tensora.store.db import Database

# -- names -------------------------------------------------------------------------------

GOOD_NAMES = ["tiny", "tiny/model.safetensors", "images/debian-12.qcow2", "a b/c", "ünïcode/модель",
              "x" * 255, "/".join(["d"] * 32), "shared-models/x", "a/shared/b"]

BAD_NAMES = {
    "empty": ("", "non-empty"),
    "parent": ("..", "starts with '.'"),
    "parent inside": ("a/../../etc/passwd", "starts with '.'"),
    "dot": (".", "starts with '.'"),
    "dot segment": ("a/./b", "starts with '.'"),
    "hidden": (".git/config", "starts with '.'"),
    "absolute": ("/etc/shadow", "relative"),
    "empty segment": ("a//b", "empty path segment"),
    "trailing slash": ("tiny/", "empty path segment"),
    "NUL": ("a\x00b", "control"),
    "newline": ("a\nb", "control"),
    "escape": ("a\x1b[31m", "control"),
    "backslash": ("a\\..\\b", "backslash"),
    "lone surrogate": ("a\udc80", "control"),
    "too long": ("x" * 513, "longer than 512"),
    "segment over 255 bytes": ("é" * 128, "longer than 255 bytes"),
    "too deep": ("/".join(["d"] * 33), "deeper than 32"),
    "shared namespace": ("shared/pool/x", "shared models"),
}


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names_pass(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(("name", "why"), BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_bad_names_are_refused_saying_why(name: str, why: str) -> None:
    with pytest.raises(BadName, match=why.replace("(", r"\(").replace("[", r"\[")):
        check_name(name)


def test_owner_dirs_are_one_safe_segment_whatever_the_owner_id() -> None:
    root = Path("/data/files")
    for owner in ("alice", "../../etc", "a/b", "", "x" * 128, "\x00"):
        d = owner_dir(root, owner)
        assert d.parent == root and d.name.isalnum() and len(d.name) == 32
    assert owner_dir(root, "alice") != owner_dir(root, "bob")


# -- resolve: one message for everything an owner may not use ------------------------------------

@dataclass
class Host:
    data: Path
    storage: Path
    shared: dict[str, Path]

    def resolve(self, owner: str, name: str) -> Path:
        return resolve(owner, name, storage_root=self.storage, shared_roots=self.shared)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    """A DATA_DIR with an admin key and a database, alice's and bob's files, and a shared root."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "admin-key").write_text("tsk_secret\n")
    (data / "tensora.db").write_bytes(b"SQLite format 3\x00")
    storage = data / "files"
    alice, bob = owner_dir(storage, "alice"), owner_dir(storage, "bob")
    (alice / "tiny").mkdir(parents=True)
    (alice / "tiny" / "model.safetensors").write_bytes(b"weights")
    (alice / "tiny" / "config.json").write_text("{}")
    (alice / "disk.qcow2").write_bytes(b"QFI\xfb")
    (alice / "alias.safetensors").symlink_to(alice / "tiny" / "model.safetensors")  # inside: fine
    (alice / "admin-key-link").symlink_to(data / "admin-key")
    (alice / "db-link").symlink_to("../../tensora.db")  # relative, out
    (alice / "bob-link").symlink_to(bob / "secret.bin")
    (alice / "etc-link").symlink_to("/etc")
    (alice / "dangling").symlink_to(alice / "nothing-here")
    (alice / "loop").symlink_to(alice / "loop")
    (alice / "evil").mkdir()
    (alice / "evil" / "model.safetensors").symlink_to(data / "admin-key")  # a model dir leaking a file
    (alice / "evil-dir").mkdir()
    (alice / "evil-dir" / "up").symlink_to(data)  # a model dir leaking a directory
    os.mkfifo(alice / "pipe")
    bob.mkdir(parents=True)
    (bob / "secret.bin").write_bytes(b"bob's")
    pool = tmp_path / "pool"
    (pool / "llama").mkdir(parents=True)
    (pool / "llama" / "model.safetensors").write_bytes(b"shared weights")
    (pool / "escape").symlink_to(data)
    return Host(data, storage, {"pool": pool, "gone": tmp_path / "not-there"})


FOUND = {
    "a model directory": ("tiny", "tiny"),
    "a file in it": ("tiny/model.safetensors", "tiny/model.safetensors"),
    "a disk image": ("disk.qcow2", "disk.qcow2"),
    "a symlink to a file inside the owner's storage": ("alias.safetensors", "tiny/model.safetensors"),
    "a shared model directory": ("shared/pool/llama", "@llama"),
    "a file of a shared model": ("shared/pool/llama/model.safetensors", "@llama/model.safetensors"),
}

NOT_FOUND_CASES = {
    "/etc/shadow": "/etc/shadow",
    "an absolute path to the admin key": "{data}/admin-key",
    "a missing file": "missing.safetensors",
    "a missing file in a model": "tiny/missing.safetensors",
    "another owner's file by its host path": "{storage}/{bob}/secret.bin",
    "another owner's file by traversal": "../{bob}/secret.bin",
    "../x": "../x",
    "traversal to the database": "tiny/../../../tensora.db",
    "a symlink to the admin key": "admin-key-link",
    "a relative symlink to the database": "db-link",
    "a symlink to another owner's file": "bob-link",
    "a symlink to /etc": "etc-link/passwd",
    "a dangling symlink": "dangling",
    "a symlink loop": "loop",
    "a model dir holding a link to the admin key": "evil",
    "a model dir holding a link to DATA_DIR": "evil-dir",
    "a fifo": "pipe",
    "the empty name": "",
    "a trailing slash": "tiny/",
    "a NUL": "tiny\x00/model.safetensors",
    "a hidden name": ".upload-123",
    "an unknown shared root": "shared/nope/llama",
    "a shared root that does not exist on the host": "shared/gone/x",
    "'shared' alone": "shared",
    "traversal out of a shared root": "shared/pool/../../data/admin-key",
    "a symlink out of a shared root": "shared/pool/escape/admin-key",
}


@pytest.mark.parametrize(("name", "want"), FOUND.values(), ids=FOUND.keys())
def test_resolve_finds_the_owners_files_and_the_shared_models(host: Host, name: str, want: str) -> None:
    base = host.shared["pool"] if want.startswith("@") else owner_dir(host.storage, "alice")
    assert host.resolve("alice", name) == (base / want.removeprefix("@")).resolve()


@pytest.mark.parametrize("name", NOT_FOUND_CASES.values(), ids=NOT_FOUND_CASES.keys())
def test_everything_else_gives_one_message_whatever_the_host_holds(host: Host, name: str) -> None:
    name = name.format(data=host.data, storage=host.storage, bob=owner_dir(host.storage, "bob").name)
    with pytest.raises(NotFound) as caught:
        host.resolve("alice", name)
    assert str(caught.value) == NOT_FOUND  # the same text for a file that exists and one that does not


def test_another_owner_cannot_name_alices_files_and_a_new_owner_has_none(host: Host) -> None:
    for owner in ("bob", "carol"):
        with pytest.raises(NotFound, match=f"^{re.escape(NOT_FOUND)}$"):
            host.resolve(owner, "tiny/model.safetensors")
    assert host.resolve("bob", "secret.bin").read_bytes() == b"bob's"


# -- bytes on disk -------------------------------------------------------------------------

def test_an_upload_publishes_atomically_and_an_abort_leaves_nothing(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "files")
    up = storage.begin("alice")
    up.write(b"abc")
    up.publish(storage.path_of("alice", "m/x.bin"))
    assert storage.path_of("alice", "m/x.bin").read_bytes() == b"abc"
    assert up.sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    gone = storage.begin("alice")
    gone.write(b"half")
    gone.abort()
    assert sorted(p.name for p in storage.dir_of("alice").iterdir()) == ["m"]
    assert oct(storage.dir_of("alice").stat().st_mode & 0o777) == "0o700"


def test_a_symlink_planted_in_the_owners_dir_cannot_redirect_a_write(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "files")
    outside = tmp_path / "outside"
    outside.mkdir()
    storage.dir_of("alice").mkdir(parents=True)
    (storage.dir_of("alice") / "m").symlink_to(outside)
    up = storage.begin("alice")
    up.write(b"x")
    with pytest.raises(Exception, match="not a plain path"):
        up.publish(storage.path_of("alice", "m/x.bin"))
    up.abort()
    assert list(outside.iterdir()) == []


def test_remove_takes_the_files_and_the_directories_they_leave_empty(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "files")
    for name in ("m/a/1", "m/a/2", "m/b", "keep"):
        up = storage.begin("alice")
        up.publish(storage.path_of("alice", name))
    storage.remove("alice", ["m/a/1", "m/a/2", "m/b"])
    assert [p.name for p in storage.dir_of("alice").iterdir()] == ["keep"]


def test_sweep_removes_only_stale_temp_files(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "files")
    old, new = storage.begin("alice"), storage.begin("alice")
    os.utime(old.tmp, (time.time() - 7200, time.time() - 7200))
    assert storage.sweep("alice", 3600, time.time()) == 1
    assert not old.tmp.exists() and new.tmp.exists()
    old.abort()
    new.abort()


# -- sandbox uids --------------------------------------------------------------------------


def uid(db: Database, owner: str, **kw: Any) -> int:
    with db.write() as conn:
        return uids_repo.owner_uid(conn, owner, 1.0, **kw)


def test_an_owners_uid_is_allocated_once_and_kept(db: Database) -> None:
    a = uid(db, "alice")
    assert uids_repo.UID_FIRST <= a <= uids_repo.UID_LAST and a not in (0, os.getuid(), os.getgid())
    b = uid(db, "bob")
    assert b != a
    assert [uid(db, "alice"), uid(db, "bob")] == [a, b]
    with db.read() as conn:
        rows = conn.execute(text("SELECT owner, uid FROM owner_uids ORDER BY uid")).all()
    assert [tuple(r) for r in rows] == [("alice", a), ("bob", b)]


def test_never_zero_nor_the_processes_own_uid_or_gid(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uids_repo.os, "getuid", lambda: 500)
    monkeypatch.setattr(uids_repo.os, "getgid", lambda: 501)
    assert uid(db, "alice", first=500, last=600) == 502
    assert uid(db, "bob", first=500, last=600, avoid=[503]) == 504
    with pytest.raises(ValueError, match=r"range 0\.\.10"):
        uid(db, "carol", first=0, last=10)


def test_a_full_range_is_a_clear_error(db: Database) -> None:
    taken = {uid(db, o, first=70000, last=70001) for o in ("alice", "bob")}
    assert taken == {70000, 70001}
    with pytest.raises(uids_repo.UidsExhausted, match=r"no free sandbox uid for owner 'carol'.*2 owners hold the range "
                                                 r"70000\.\.70001; widen it"):
        uid(db, "carol", first=70000, last=70001)
    assert uid(db, "alice", first=70000, last=70001) in taken  # those allocated still read back


@pytest.mark.parametrize("who", ["the same owner", "another owner"])
def test_a_first_call_racing_an_uncommitted_one(db: Database, who: str) -> None:
    """The second call runs while the first's row is inserted but not committed: on PostgreSQL it
    waits on that row (seen in pg_locks), then reads the same uid (same owner) or takes the next
    one (another owner, whose number was taken). SQLite's writes take turns."""
    second: dict[str, Any] = {}
    other = "alice" if who == "the same owner" else "bob"

    def call() -> None:
        try:
            second["uid"] = uid(db, other)
        except Exception as exc:  # kept for the assertion below
            second["error"] = exc

    thread = threading.Thread(target=call)
    with db.write() as conn:
        first = uids_repo.owner_uid(conn, "alice", 1.0)
        thread.start()
        if db.engine.dialect.name == "postgresql":
            with db.engine.connect() as watch:
                for _ in range(200):
                    if watch.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
                        break
                    time.sleep(0.05)
                else:
                    pytest.fail("the second call never waited on the first")
    thread.join(timeout=10)
    assert "error" not in second, second.get("error")
    assert second["uid"] == (first if other == "alice" else first + 1)


def test_many_owners_at_once_get_one_distinct_uid_each(db: Database) -> None:
    owners = [f"o{i % 6}" for i in range(24)]  # each owner asked for by 4 threads
    got: dict[int, int] = {}
    errors: list[Exception] = []
    start = threading.Barrier(len(owners))

    def call(i: int) -> None:
        start.wait()
        try:
            got[i] = uid(db, owners[i])
        except Exception as exc:  # kept for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(owners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    by_owner: dict[str, set[int]] = {}
    for i, u in got.items():
        by_owner.setdefault(owners[i], set()).add(u)
    assert all(len(us) == 1 for us in by_owner.values()), by_owner
    assert len({next(iter(us)) for us in by_owner.values()}) == 6
