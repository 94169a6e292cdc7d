"""The profiles ``tensora login`` saves, read by the CLI and by the SDK's :class:`~tensora.sdk.Client`.

The file (``$TENSORA_CONFIG``, default ``~/.config/tensora/profiles.json``) holds named profiles and which one is
current: ``{"current": NAME, "profiles": {NAME: {"api_url", "api_key", "gateway_url"}}}``. It is written by the CLI
(``tensora.cli.profile.save``: mode 0600, whole or not at all); here it is only read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from tensora.errors import ConfigError


def config_path() -> Path:
    env = os.environ.get("TENSORA_CONFIG")
    return Path(env) if env else Path(platformdirs.user_config_dir("tensora")) / "profiles.json"


def read_profiles(path: Path) -> dict[str, Any]:
    """The file's contents; an empty set of profiles when there is no file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"current": "default", "profiles": {}}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the profile file: {exc}", source=str(path)) from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise ConfigError("not a profile file: expected {'current': ..., 'profiles': {...}}", source=str(path))
    return data


@dataclass(frozen=True)
class Profile:
    """One saved profile: where the API and the gateway are, and the key (any of them may be missing)."""

    name: str
    path: Path
    api_url: str | None
    api_key: str | None
    gateway_url: str | None


def current_profile() -> Profile | None:
    """The profile the CLI uses when no ``--profile`` is given; None when there is none (or the file is not one:
    the SDK then goes on without it, and its 401 says where it looked)."""
    path = config_path()
    try:
        data = read_profiles(path)
    except ConfigError:
        return None
    name = data.get("current") or "default"
    saved = data["profiles"].get(name)
    if not isinstance(name, str) or not isinstance(saved, dict):
        return None

    def text(key: str) -> str | None:
        value = saved.get(key)
        return value if isinstance(value, str) and value else None

    return Profile(name, path, text("api_url"), text("api_key"), text("gateway_url"))
