"""The sandbox listeners: which host port each forward of a sandbox reaches (the API's and the gateway's sandbox
listeners, from their settings), the settings' checks, and a port that cannot be bound named by its setting."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tensora import listeners
from tensora.config.settings import ServeSettings
from tensora.errors import ConfigError
from tensora.gateway.app import GatewaySettings
from tensora.serve import gateway_settings_for, sandbox_forwards

DATA = Path("/srv/tensora")


@dataclass(frozen=True)
class Case:
    settings: dict[str, Any]
    want: list[tuple[int, int]]
    env: dict[str, str] = field(default_factory=dict)


FORWARDS = {
    "defaults: each server's port + 20": Case({}, [(8700, 8720), (8701, 8721)]),
    "ports moved: their sandbox listeners move with them": Case(
        {"port": 9000, "gateway_port": 9001}, [(9000, 9020), (9001, 9021)]),
    "sandbox ports set": Case(
        {"sandbox_port": 18000, "gateway": {"sandbox_port": 18001}}, [(8700, 18000), (8701, 18001)]),
    "the gateway's sandbox port from its environment variable": Case(
        {}, [(8700, 8720), (8701, 19001)], env={"TENSORA_GATEWAY_SANDBOX_PORT": "19001"}),
    "the gateway's port from its section": Case({"gateway": {"port": 9101}}, [(8700, 8720), (9101, 9121)]),
    "an ephemeral API port: not forwarded": Case({"port": 0}, [(8701, 8721)]),
    "a port too high for + 20: no listener, the port itself": Case({"port": 65530}, [(65530, 65530), (8701, 8721)]),
}


@pytest.mark.parametrize("case", FORWARDS.values(), ids=FORWARDS.keys())
def test_sandbox_forwards(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    settings = ServeSettings(data_dir=DATA, driver="local", **case.settings)
    assert sandbox_forwards(settings) == case.want


def test_only_the_local_driver_has_sandbox_listeners() -> None:
    for driver in ("simulated", "kubernetes"):
        settings = ServeSettings(data_dir=DATA, driver=driver)
        assert settings.sandbox_listener() is None
        assert gateway_settings_for(settings).sandbox_port is None
    assert ServeSettings(data_dir=DATA, driver="local").sandbox_listener() == 8720


SAME_PORT = {
    "the API": lambda: ServeSettings(data_dir=DATA, port=9000, sandbox_port=9000),
    "the gateway": lambda: GatewaySettings(data_dir=DATA, port=9001, sandbox_port=9001),
}


@pytest.mark.parametrize("make", SAME_PORT.values(), ids=SAME_PORT.keys())
def test_a_sandbox_port_equal_to_the_port_is_refused(make: Any) -> None:
    with pytest.raises(ValidationError, match="sandbox_port: must differ from port"):
        make()


DERIVED = {"8700": (8700, 8720), "ephemeral": (0, None), "the highest that fits": (65515, 65535),
           "too high": (65516, None)}


@pytest.mark.parametrize("case", DERIVED.values(), ids=DERIVED.keys())
def test_derived(case: tuple[int, int | None]) -> None:
    port, want = case
    assert listeners.derived(port) == want


def test_a_taken_sandbox_port_is_named_by_its_setting() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            listeners.listen(taken, "gateway.sandbox_port")
    assert str(caught.value) == (f"gateway.sandbox_port: cannot listen on 127.0.0.1:{taken} for sandboxes "
                                 "(Address already in use): choose another port")


def test_a_sandbox_listener_is_on_loopback_and_inheritable() -> None:
    s = listeners.listen(0, "sandbox_port")
    with s:
        assert s.getsockname()[0] == "127.0.0.1" and s.get_inheritable()
