"""The control API's HTTP server against hostile clients, over raw sockets, as ``tensora serve`` really runs it
(its HTTP worker process under uvicorn's supervisor, the controller beside it): endless and oversized headers,
connections that send nothing or stop half-way, one client address opening every connection it can, bodies
over the JSON bound, and an upload past that bound that must still stream. The bounds are set low through the
server's settings (``TENSORA_*``) so that a few dozen connections reach them."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.services import free_port, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@dataclass(frozen=True)
class Api:
    url: str
    port: int
    key: str
    data_dir: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@contextlib.contextmanager
def serving(tmp_path: Path, *, single: bool = False, **settings: str) -> Iterator[Api]:
    """``tensora serve`` (``single``: ``--no-controller``, the API in this one process) with ``settings`` as
    ``TENSORA_<NAME>`` variables; stopped by its pid."""
    port = free_port()
    env = {**os.environ, "TENSORA_TICK_S": "60", "TENSORA_METRICS_LISTEN": "",
           **{f"TENSORA_{k.upper()}": v for k, v in settings.items()}}
    data = tmp_path / "data"
    log_path = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "tensora.cli", "serve", "--data-dir", str(data), "--port", str(port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv + (["--no-controller"] if single else []), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=2).status_code == 200 and (data / "admin-key").exists():
                    break
            assert time.monotonic() < deadline, "tensora serve did not start: " + log_path.read_text()
            time.sleep(0.2)
        yield Api(url, port, (data / "admin-key").read_text().strip(), data)
    finally:
        stop(proc)


def connect(api: Api, source: str = "127.0.0.1") -> socket.socket:
    """A connection from ``source`` (any 127.x address: Linux answers on all of 127.0.0.0/8)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", api.port))
    return s


def read_all(s: socket.socket, until: float = 20.0) -> tuple[bytes, bool]:
    """What the server sends until it closes the connection, and whether it closed it (False: ``until`` seconds
    went by first)."""
    s.settimeout(until)
    out = b""
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        pass
    return out, True


def read_each(socks: list[socket.socket], within: float = 30.0) -> list[tuple[bytes, bool]]:
    """``read_all`` of each socket, all of them within ``within`` seconds together (they were held together)."""
    deadline = time.monotonic() + within
    return [read_all(s, max(0.1, deadline - time.monotonic())) for s in socks]


def answered(s: socket.socket) -> bool:
    """Whether the server has sent anything (or closed) on ``s`` yet; does not wait."""
    ready, _, _ = select.select([s], [], [], 0)
    return bool(ready)


def send_all(s: socket.socket, data: bytes) -> None:
    """As much as the server takes: it may answer and stop reading half-way (that is the point)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(data)


def get(path: str = "/healthz", headers: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n"


class Dribbler:
    """Sends a few bytes to each socket every ``every_s`` until the server stops taking them, or until told to
    stop, or ``rounds`` rounds (a bound, not a wait)."""

    def __init__(self, socks: list[socket.socket], piece: bytes, every_s: float = 0.2, rounds: int = 600) -> None:
        self.socks, self.piece, self.every_s, self.rounds = socks, piece, every_s, rounds
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        live = list(self.socks)
        for _ in range(self.rounds):
            if self.stop.is_set() or not live:
                return
            for s in list(live):
                try:
                    s.send(self.piece)
                except OSError:
                    live.remove(s)  # answered and closed (or reset): the server dropped it
            self.stop.wait(self.every_s)

    def __enter__(self) -> Dribbler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_endless_headers_are_answered_408_while_healthz_and_a_revoke_are_served(tmp_path: Path) -> None:
    """20 connections each dribbling a header that never ends, and 2 pouring one out as fast as they can: the first
    are answered 408 and closed, the others 431; while they are held, /healthz and an admin's key revoke from
    another connection are answered, and the key is revoked."""
    with serving(tmp_path, header_timeout_s="10") as api:
        made = httpx.post(api.url + "/v1/keys", headers=api.auth, json={"name": "leaked"}, timeout=10)
        assert made.status_code == 201, made.text
        leaked, leaked_id = made.json()["key"], made.json()["id"]
        slow = [connect(api) for _ in range(20)]
        fast = [connect(api) for _ in range(2)]
        try:
            for s in slow + fast:
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-endless: ")
            with Dribbler(slow, b"a" * 40), Dribbler(fast, b"a" * (256 << 10), every_s=0.01, rounds=2000):
                with httpx.Client(base_url=api.url, timeout=30) as client:
                    health = client.get("/healthz")
                    revoke = client.delete(f"/v1/keys/{leaked_id}", headers=api.auth)
                    after = client.get("/v1/keys", headers={"Authorization": f"Bearer {leaked}"})
                held_meanwhile = [not answered(s) for s in slow]
                ends = read_each(slow)
                poured = read_each(fast)
        finally:
            for s in slow + fast:
                s.close()
    assert health.status_code == 200 and revoke.status_code == 204, (health.text, revoke.text)
    assert after.status_code == 401, after.text
    assert all(held_meanwhile), "the slow connections were dropped before the revoke was answered"
    assert all(out.startswith(b"HTTP/1.1 408") and closed for out, closed in ends), ends[0]
    assert all(out.startswith(b"HTTP/1.1 431") and closed for out, closed in poured), poured[0]


def test_one_client_address_cannot_take_every_connection(tmp_path: Path) -> None:
    """Half-sent requests from 127.0.0.1, past its share (10 of 40): that client is answered 503 with Retry-After,
    127.0.0.2 is still served; past the server's cap, everyone is answered 503 with Retry-After."""
    with serving(tmp_path, header_timeout_s="60", max_connections="40", max_connections_per_client="10") as api:
        half = b"GET /healthz HTTP/1.1\r\nhost: x\r\n"
        held = [connect(api) for _ in range(10)]
        flood = [connect(api) for _ in range(20)]
        others: list[socket.socket] = []
        try:
            for s in held + flood:
                send_all(s, half)
            with connect(api, "127.0.0.2") as other:
                other.sendall(get(headers=b"connection: close\r\n"))
                answer, _ = read_all(other)
            refused = [out for out, _ in read_each(flood, 10)]
            # the whole cap: 10 more clients' 3 connections each fill it with those 10 held
            others = [connect(api, f"127.0.1.{i}") for i in range(1, 11) for _ in range(3)]
            for s in others:
                send_all(s, half)
            with connect(api, "127.0.0.3") as late:
                send_all(late, get(headers=b"connection: close\r\n"))
                full, _ = read_all(late)
            held_meanwhile = [not answered(s) for s in held + others]
        finally:
            for s in held + flood + others:
                s.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert all(r.startswith(b"HTTP/1.1 503") and b"\r\nretry-after: " in r.lower() for r in refused), refused[0]
    assert full.startswith(b"HTTP/1.1 503") and b"\r\nretry-after: " in full.lower(), full[:300]
    assert all(held_meanwhile)


HEADS = [  # (name, request head, expected status)
    ("a 16 KiB header", get(headers=b"x-big: " + b"a" * (16 << 10) + b"\r\n"), 431),
    ("a 16 KiB request line", get("/healthz?" + "a" * (16 << 10)), 431),
    ("a header that goes on for 4 MiB", get(headers=b"x-big: " + b"a" * (4 << 20) + b"\r\n"), 431),
    ("21 headers", get(headers=b"".join(b"x-h%d: v\r\n" % i for i in range(20))), 431),
    ("20 headers", get(headers=b"".join(b"x-h%d: v\r\n" % i for i in range(19))), 200),
    ("a 6 KiB header", get(headers=b"x-big: " + b"a" * (6 << 10) + b"\r\n"), 200),
]


@pytest.fixture(scope="module")
def small_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with serving(tmp_path_factory.mktemp("small"), max_header_bytes="8192", max_headers="20",
                 max_body_bytes="65536", idle_timeout_s="5") as api:
        yield api


@pytest.mark.parametrize(("head", "status"), [(h, s) for _, h, s in HEADS], ids=[n for n, *_ in HEADS])
def test_header_size_and_count_are_bounded(small_api: Api, head: bytes, status: int) -> None:
    with connect(small_api) as s:
        send_all(s, head)
        out, _ = read_all(s, 10)
    assert out.startswith(b"HTTP/1.1 %d" % status), out[:300]


def test_a_json_body_over_the_bound_is_413_before_it_is_sent(small_api: Api) -> None:
    with connect(small_api) as s:
        s.sendall(b"POST /v1/workloads HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + small_api.key.encode()
                  + b"\r\ncontent-type: application/json\r\ncontent-length: 2000000\r\n\r\n")
        out, _ = read_all(s, 10)  # not one byte of the body was sent
    assert out.startswith(b"HTTP/1.1 413"), out[:300]


def test_a_connection_that_sends_nothing_is_closed(small_api: Api) -> None:
    with connect(small_api) as s:
        out, closed = read_all(s, 30)
    assert closed and out == b""


def test_a_body_that_stops_coming_is_408(small_api: Api) -> None:
    with connect(small_api) as s:
        s.sendall(b"POST /v1/workloads HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + small_api.key.encode()
                  + b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"kind\": ")
        out, closed = read_all(s, 30)
    assert out.startswith(b"HTTP/1.1 408") and closed, out[:300]


def test_an_upload_past_the_json_bound_streams_and_its_own_bound_holds(small_api: Api) -> None:
    """3 MiB with a JSON bound of 64 KiB: it is written to disk while it is still coming (never held whole),
    then stored; 5 MiB against a 4 MiB quota is 413."""
    size = 3 << 20
    quota = httpx.put(small_api.url + "/v1/owners/admin", headers=small_api.auth,
                      json={"quotas": {"storage_bytes": 4 << 20}}, timeout=10)
    assert quota.status_code == 200, quota.text
    with connect(small_api) as s:
        s.sendall(b"PUT /v1/files/big.bin HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + small_api.key.encode()
                  + b"\r\ncontent-length: %d\r\n\r\n" % size)
        s.sendall(b"x" * (2 << 20))
        rest, on_disk = size - (2 << 20), 0
        piece = 16 << 10
        while rest > 0:  # until a batch of it is on disk, the body kept coming a piece at a time (bounded)
            on_disk = max((p.stat().st_size for p in (small_api.data_dir / "files").rglob(".upload-*")), default=0)
            if on_disk >= 1 << 20:
                break
            s.sendall(b"x" * piece)
            rest -= piece
            time.sleep(0.1)
        s.sendall(b"x" * rest)
        out, _ = read_all(s, 10)
    assert on_disk >= 1 << 20
    assert out.startswith(b"HTTP/1.1 201"), out[:300]

    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            yield b"y" * (1 << 20)

    over = httpx.put(small_api.url + "/v1/files/over.bin", headers=small_api.auth, content=chunks(), timeout=30)
    assert over.status_code == 413, over.text


def test_the_bounds_hold_in_the_single_process_server(tmp_path: Path) -> None:
    """``tensora serve --no-controller`` serves the API in its own process, not under the supervisor."""
    with serving(tmp_path, single=True, max_header_bytes="8192", header_timeout_s="2") as api:
        with connect(api) as big:
            send_all(big, get(headers=b"x-big: " + b"a" * (16 << 10) + b"\r\n"))
            too_big, _ = read_all(big, 10)
        with connect(api) as slow:
            slow.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-endless: a")
            late, closed = read_all(slow, 30)
    assert too_big.startswith(b"HTTP/1.1 431"), too_big[:300]
    assert late.startswith(b"HTTP/1.1 408") and closed, late[:300]
