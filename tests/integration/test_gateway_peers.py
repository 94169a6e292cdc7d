"""Peer gateways get the caller's own key, so the way to them is checked: ``https://`` is spoken with
TLS and a verified certificate (never plain HTTP on port 80), and a plain ``http://`` peer off
loopback is refused when the settings load, naming the setting. Real TLS (openssl-made CA and
certificates), a real peer gateway on uvicorn with TLS, a fake model server behind it."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tensora.config.settings import layered
from tensora.errors import ConfigError
from tensora.gateway.app import GatewaySettings
from tensora.gateway.breaker import Policy
from tensora.gateway.chain import Peer
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.upstream import peer_url_problem
from tensora.keys import apikeys
from tests.support.gateway_harness import Backends, chat, make_table, replica, serving
from tests.support.services import free_port

pytestmark = pytest.mark.timeout(90)

ALICE = apikeys.generate()
KEYS = {ALICE: ("alice", ["inference"])}


def local_gateway(peer_url: str, **opts: Any) -> Gateway:
    """Region local: my-llm's one replica is down, so a request goes to the peer in region us."""
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice", "allow_cross_region": True,
                         "replicas": [replica("r1", f"http://127.0.0.1:{free_port()}/v1")]}], KEYS)
    o = Options(ttft_s=1.0, deadline_s=4.0, breaker=Policy(consecutive=1000), peers=(Peer("us", peer_url),), **opts)
    return Gateway(o, lambda: table, MemoryLimiter(), None)


def post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=chat(), headers={"Authorization": f"Bearer {ALICE}"},
                      timeout=20)


def test_an_https_peer_is_never_spoken_to_in_plain_http() -> None:
    """The attack: a listener on the peer's port records what arrives. The caller's key must not."""
    got: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def record() -> None:
        conn, _ = listener.accept()
        conn.settimeout(1.5)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                data += chunk
        got.append(data)
        conn.close()

    t = threading.Thread(target=record, daemon=True)
    t.start()
    port = listener.getsockname()[1]
    with serving(local_gateway(f"https://127.0.0.1:{port}/v1")) as url:
        r = post(url)
    t.join(5)
    listener.close()
    assert got and got[0], "the gateway did not connect to the peer"
    assert ALICE.encode() not in got[0] and b"POST" not in got[0]
    assert got[0][:1] == b"\x16"  # a TLS handshake record
    assert r.status_code == 503 and "peer:us:" in r.headers["x-tensora-attempts"]


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a certificate it signs for 127.0.0.1, and one it signs for another name."""
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
            "-keyout", d / "ca.key", "-out", d / "ca.pem")
    for name, san in (("good", "IP:127.0.0.1"), ("wrong", "DNS:other.example")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", d / f"{name}.key",
                "-out", d / f"{name}.csr")
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        openssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.pem", "-CAkey", d / "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", d / f"{name}.ext", "-out", d / f"{name}.pem")
    return {"ca": d / "ca.pem", **{n: d / f"{n}.pem" for n in ("good", "wrong")},
            **{f"{n}.key": d / f"{n}.key" for n in ("good", "wrong")}}


@contextlib.contextmanager
def tls_peer(backends: Backends, cert: Path, key: Path) -> Iterator[str]:
    """Region us's gateway over TLS, serving my-llm from its own replica."""
    table = make_table([{"id": "wl_us", "name": "my-llm", "owner": "alice", "region": "us",
                         "replicas": [replica("us1", backends.url("us1"))]}], KEYS, region="us")
    gw = Gateway(Options(region="us"), lambda: table, MemoryLimiter(), None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gw, host="127.0.0.1", port=port, log_level="error", lifespan="on",
                                           ssl_certfile=str(cert), ssl_keyfile=str(key)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"https://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def backends() -> Iterator[Backends]:
    b = Backends(["us1"])
    try:
        yield b
    finally:
        b.close()


TLS = [  # (name, the peer's certificate, the CA the local gateway trusts, answered by the peer)
    ("signed by a trusted CA for its address", "good", True, True),
    ("signed by an untrusted CA", "good", False, False),
    ("for another name", "wrong", True, False),
]


@pytest.mark.parametrize(("cert", "trusted", "ok"), [t[1:] for t in TLS], ids=[t[0] for t in TLS])
def test_an_https_peer_needs_a_verified_certificate(backends: Backends, certs: dict[str, Path], cert: str,
                                                   trusted: bool, ok: bool) -> None:
    before = backends.requests("us1")
    with tls_peer(backends, certs[cert], certs[f"{cert}.key"]) as peer_url:
        gw = local_gateway(peer_url)
        if trusted:
            gw.client.tls = ssl.create_default_context(cafile=str(certs["ca"]))
        with serving(gw) as url:
            r = post(url)
    if ok:
        assert r.status_code == 200, r.text
        assert r.headers["x-tensora-region"] == "us" and r.headers["x-tensora-attempts"].endswith("peer:us:ok")
        assert backends.requests("us1") == before + 1
    else:
        assert r.status_code == 503
        assert r.headers["x-tensora-attempts"].endswith("peer:us:tls_error")
        assert backends.requests("us1") == before


PEER_URLS = [  # (url, the problem, None when fine)
    ("https://gw.eu.example.com/v1", None),
    ("https://10.0.0.5:8443/v1", None),
    ("http://127.0.0.1:8701/v1", None),
    ("http://localhost:8701/v1", None),
    ("http://[::1]:8701/v1", None),
    ("http://10.0.0.5:8701/v1", "plain http to 10.0.0.5"),
    ("http://gw.eu.example.com/v1", "plain http to gw.eu.example.com"),
    ("http://127.0.0.1.evil.example/v1", "plain http to 127.0.0.1.evil.example"),
    ("ftp://gw.eu.example.com/v1", "the scheme must be http or https"),
    ("gw.eu.example.com/v1", "the scheme must be http or https"),
    ("https:///v1", "it names no host"),
]


@pytest.mark.parametrize(("url", "problem"), PEER_URLS, ids=[u for u, _ in PEER_URLS])
def test_peer_urls_are_checked(url: str, problem: str | None) -> None:
    found = peer_url_problem(url)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_a_plain_http_peer_off_loopback_is_refused_at_start_naming_the_setting(tmp_path: Path) -> None:
    values = {"data_dir": tmp_path, "peers": [{"region": "us", "url": "https://gw.us.example.com/v1"},
                                              {"region": "eu", "url": "http://10.0.0.5:8701/v1"}]}
    with pytest.raises(ConfigError) as e:
        layered(GatewaySettings, dict(values), {"peers": "gateway"}, {}, "TENSORA_GATEWAY_", {},
                field_prefix="gateway.")
    assert e.value.field == "gateway.peers"
    assert "peers[1].url (eu)" in e.value.message and "use https" in e.value.message
    values["peers"] = values["peers"][:1]  # type: ignore[index]
    assert GatewaySettings.model_validate(values).options().peers == (Peer("us", "https://gw.us.example.com/v1"),)
