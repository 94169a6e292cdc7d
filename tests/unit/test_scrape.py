"""``metrics_listen``: what the setting accepts, and null or empty turning the metrics off."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tensora.config.settings import ServeSettings
from tensora.gateway.app import GatewaySettings
from tensora.telemetry.scrape import check_listen, parse_listen

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
