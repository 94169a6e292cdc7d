"""``metrics_listen``: what the setting accepts, null or empty turning the metrics off, the default beside each
server's own port (so that a second ``tensora up`` on other ports has listeners of its own), and a taken address
stopping the server with the setting to change."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tensora.config.settings import ServeSettings, load_settings
from tensora.errors import ConfigError
from tensora.gateway.app import GatewaySettings
from tensora.serve import gateway_settings_for
from tensora.serving.ports import Occupied, check_metrics, distinct_ports
from tensora.telemetry.scrape import check_free, check_listen, derived_listen, parse_listen

GOOD = [("loopback", "127.0.0.1:8710", ("127.0.0.1", 8710)), ("all interfaces", "0.0.0.0:8711", ("0.0.0.0", 8711)),
        ("no host: all", ":9100", ("0.0.0.0", 9100)), ("a name", "localhost:1", ("localhost", 1)),
        ("ipv6 in brackets", "[::1]:8710", ("::1", 8710)), ("any free port", "127.0.0.1:0", ("127.0.0.1", 0))]
BAD = [("no port", "127.0.0.1"), ("port too large", "127.0.0.1:65536"), ("ipv6 bare", "::1:8710"),
       ("a URL", "http://127.0.0.1:8710"), ("a path", "127.0.0.1:8710/metrics"), ("letters", "host:port")]


@pytest.mark.parametrize(("value", "expected"), [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_parse_listen(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize("value", [c[1] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_listen_is_refused_by_both_settings(value: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_listen(value)
    with pytest.raises(ValidationError, match="metrics_listen"):
        ServeSettings(metrics_listen=value)
    with pytest.raises(ValidationError, match="metrics_listen"):
        GatewaySettings(data_dir=tmp_path, metrics_listen=value)


def test_null_or_empty_turns_metrics_off_and_the_defaults_are_loopback() -> None:
    assert check_listen(None) is None and check_listen("") is None
    assert ServeSettings().metrics_listen == "127.0.0.1:8710"
    assert GatewaySettings(data_dir=Path("/tmp")).metrics_listen == "127.0.0.1:8711"
    assert ServeSettings(metrics_listen=None).metrics_listen is None


@dataclass(frozen=True)
class Derived:
    listen: Callable[[Path], str | None]
    want: str | None


def _up_gateway(tmp: Path, **server: Any) -> str | None:
    """The metrics address of ``tensora up``'s gateway for these server settings."""
    settings = ServeSettings(data_dir=tmp, **server)
    listen: str | None = gateway_settings_for(settings, {"port": settings.gateway_port}, env={}).metrics_listen
    return listen


DERIVED = {
    "the API's default port 8700 -> 8710": Derived(lambda t: ServeSettings().metrics_listen, "127.0.0.1:8710"),
    "the gateway's default port 8701 -> 8711": Derived(lambda t: GatewaySettings(data_dir=t).metrics_listen,
                                                        "127.0.0.1:8711"),
    "tensora up's gateway on its default port -> 8711": Derived(lambda t: _up_gateway(t), "127.0.0.1:8711"),
    "a second up's API on --port 8800 -> 8810": Derived(
        lambda t: load_settings(None, {"port": 8800}, env={}).metrics_listen, "127.0.0.1:8810"),
    "a second up's gateway on --gateway-port 8801 -> 8811": Derived(
        lambda t: _up_gateway(t, port=8800, gateway_port=8801), "127.0.0.1:8811"),
    "the port from TENSORA_PORT -> beside it": Derived(
        lambda t: load_settings(None, {}, env={"TENSORA_PORT": "9000"}).metrics_listen, "127.0.0.1:9010"),
    "a standalone gateway on --port 9001 -> 9011": Derived(
        lambda t: GatewaySettings(data_dir=t, port=9001).metrics_listen, "127.0.0.1:9011"),
    "the API bound to all interfaces: metrics stay on loopback": Derived(
        lambda t: ServeSettings(host="0.0.0.0", port=8800).metrics_listen, "127.0.0.1:8810"),
    "set: as set, whatever the port": Derived(
        lambda t: ServeSettings(port=8800, metrics_listen="0.0.0.0:9100").metrics_listen, "0.0.0.0:9100"),
    "the gateway's set in up's config: as set": Derived(
        lambda t: _up_gateway(t, port=8800, gateway={"metrics_listen": "127.0.0.1:9111"}), "127.0.0.1:9111"),
    "null: no metrics": Derived(lambda t: ServeSettings(port=8800, metrics_listen=None).metrics_listen, None),
    "empty TENSORA_METRICS_LISTEN: no metrics": Derived(
        lambda t: load_settings(None, {"port": 8800}, env={"TENSORA_METRICS_LISTEN": ""}).metrics_listen, None),
    "an ephemeral port (0): no metrics": Derived(lambda t: ServeSettings(port=0).metrics_listen, None),
    "a port with no room above it: no metrics": Derived(lambda t: ServeSettings(port=65530).metrics_listen, None),
}


@pytest.mark.parametrize("case", DERIVED.values(), ids=DERIVED.keys())
def test_the_default_listener_is_beside_its_servers_port(case: Derived, tmp_path: Path) -> None:
    assert case.listen(tmp_path) == case.want


@pytest.mark.parametrize(("port", "want"), [(1, "127.0.0.1:11"), (65525, "127.0.0.1:65535"), (65526, None),
                                            (0, None)])
def test_derived_listen_bounds(port: int, want: str | None) -> None:
    assert derived_listen(port) == want


def test_a_taken_metrics_address_names_it_and_the_setting() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as got:
            check_free(f"127.0.0.1:{port}", "metrics_listen")
        assert str(got.value) == (f"metrics_listen: cannot serve metrics on 127.0.0.1:{port} (Address already in "
                                  "use): set metrics_listen to a free host:port, or to null for no metrics")
        with pytest.raises(Occupied) as taken:
            check_metrics(f"127.0.0.1:{port}", "gateway.metrics_listen")
        assert str(taken.value) == (f"cannot serve metrics on 127.0.0.1:{port}: another program (not Tensora) "
                                    "listens there; set gateway.metrics_listen to a free host:port, or to null for "
                                    "no metrics")
    check_free(f"127.0.0.1:{port}", "metrics_listen")  # free again
    check_metrics(None, "metrics_listen")  # off: nothing to check


def test_one_servers_listeners_take_ports_apart() -> None:
    distinct_ports([(8700, "--port"), (8701, "--gateway-port"), (None, "sandbox_port"), (0, "metrics_listen")])
    with pytest.raises(Occupied) as got:
        distinct_ports([(8700, "--port"), (8710, "--gateway-port"), (8710, "metrics_listen")])
    assert str(got.value) == ("--gateway-port and metrics_listen would both listen on port 8710: choose another "
                              "with metrics_listen")
