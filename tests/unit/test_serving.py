"""How ``tensora serve`` and ``tensora up`` run as processes (``tensora.serving``): which process listens on a port
(read from ``/proc/net/tcp``), where a client reaches a server, what ``tensora up`` says when a Tensora runs, and
what an HTTP worker is handed."""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from tensora.config.settings import ServeSettings
from tensora.serve import worker_app
from tensora.serving.ports import already_running, client_host, listening_inodes
from tensora.serving.workers import WorkerBrief, worker_settings_json

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")


def row(local: str, state: str, inode: int) -> str:
    return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  1000        0 {inode} 1 0\n"


@dataclass(frozen=True)
class Case:
    table: str
    port: int
    want: set[str]


CASES = {
    "a listener on the port -> its inode": Case(HEADER + row("0100007F:21FC", "0A", 111), 8700, {"socket:[111]"}),
    "an established connection on the port -> none": Case(HEADER + row("0100007F:21FC", "01", 112), 8700, set()),
    "a listener on another port -> none": Case(HEADER + row("0100007F:21FD", "0A", 113), 8700, set()),
    "an IPv6 listener -> its inode": Case(HEADER + row("00000000000000000000000000000000:21FC", "0A", 114), 8700,
                                          {"socket:[114]"}),
    "two listeners (SO_REUSEPORT) -> both": Case(
        HEADER + row("0100007F:21FC", "0A", 115) + row("00000000:21FC", "0A", 116), 8700,
        {"socket:[115]", "socket:[116]"}),
    "the header alone -> none": Case(HEADER, 8700, set()),
    "a short line -> skipped": Case(HEADER + "   0: 0100007F:21FC\n", 8700, set()),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_listening_inodes(case: Case) -> None:
    assert listening_inodes(case.table, case.port) == case.want


@pytest.mark.parametrize(("bind", "want"), [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("", "127.0.0.1"),
                                            ("127.0.0.1", "127.0.0.1"), ("10.0.0.5", "10.0.0.5")])
def test_a_client_reaches_a_wildcard_bind_on_the_loopback(bind: str, want: str) -> None:
    assert client_host(bind) == want


@pytest.mark.parametrize(("api", "pid", "want"), [
    ("127.0.0.1:8700", 42, "Tensora is already running on 127.0.0.1:8700 (pid 42)"),
    ("127.0.0.1:8700", None, "Tensora is already running on 127.0.0.1:8700"),
    (None, None, "Tensora is already running on this data dir"),
])
def test_already_running_names_where_and_which_process(api: str | None, pid: int | None, want: str) -> None:
    assert already_running(api, pid) == want


def test_a_worker_is_handed_its_settings_as_its_factorys_pickled_argument(tmp_path: Path) -> None:
    """What uvicorn's supervisor sends a spawned worker: the factory and its brief, whole, settings validated again."""
    settings = ServeSettings(data_dir=tmp_path, database_url="postgresql://u:secret@db/tensora", storage_quota="5Gi")
    brief = WorkerBrief(worker_settings_json(settings), 4242, "controller-abc", "127.0.0.1:8711")
    factory = pickle.loads(pickle.dumps(functools.partial(worker_app, brief)))
    assert factory.func is worker_app
    (sent,) = factory.args
    assert sent == brief
    back = sent.settings()
    assert back.database_url == settings.database_url
    assert back.owner_defaults() == settings.owner_defaults()
