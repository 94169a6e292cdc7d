"""Where the CLI finds its API, gateway and key: flags, then TENSORA_* env, then the profile file
``tensora login`` writes, then the one-machine defaults. ``tensora login`` against an API on this
machine (a loopback address) finds the admin key ``tensora up`` wrote in its data dir by itself.

The file (``$TENSORA_CONFIG``, default ``~/.config/tensora/profiles.json``) holds named
profiles; it is written whole to a temp file of mode 0600 and renamed, so it is never
half-written nor readable by others, and a key in it is never printed back.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tensora.errors import ConfigError


@dataclass(frozen=True)
class Target:
    api_url: str
    api_key: str | None
    gateway_url: str
    profile: str


def resolve(api_url: str | None, api_key: str | None, gateway_url: str | None, profile: str | None) -> Target:
    """Flags (already merged with env by typer) over the profile over the defaults."""
    from tensora.sdk.client import DEFAULT_API_URL, DEFAULT_GATEWAY_URL  # the SDK only where a command calls it
    from tensora.sdk.profiles import config_path, read_profiles

    path = config_path()
    data = read_profiles(path)
    name = profile or data.get("current") or "default"
    saved = data["profiles"].get(name)
    if profile is not None and saved is None:
        raise ConfigError(f"no profile {profile!r}; run tensora login --profile {profile}", source=str(path),
                          field="profile")
    saved = saved if isinstance(saved, dict) else {}
    return Target(api_url=api_url or saved.get("api_url") or DEFAULT_API_URL,
                  api_key=api_key or saved.get("api_key"),
                  gateway_url=gateway_url or saved.get("gateway_url") or DEFAULT_GATEWAY_URL, profile=name)


def save(name: str, api_url: str, api_key: str, gateway_url: str) -> Path:
    """Write (or replace) profile ``name`` and make it the current one; returns the file."""
    from tensora.sdk.profiles import config_path, read_profiles

    path = config_path()
    data = read_profiles(path)
    data["profiles"][name] = {"api_url": api_url, "api_key": api_key, "gateway_url": gateway_url}
    data["current"] = name
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".profiles-", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine: ``localhost``, 127.0.0.0/8 or ``::1``."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_admin_key(api_url: str, env: Mapping[str, str]) -> Path | None:
    """The admin key file of ``tensora up`` on this machine, when ``api_url`` is on a loopback address
    and the data dir (``TENSORA_DATA_DIR``, else the user's data dir: as ``tensora up`` resolves it)
    holds a readable one; else None."""
    if not is_loopback(api_url):
        return None
    from tensora.config.settings import ADMIN_KEY_FILE, default_data_dir

    data_dir = Path(env["TENSORA_DATA_DIR"]) if env.get("TENSORA_DATA_DIR") else default_data_dir()
    path = data_dir / ADMIN_KEY_FILE
    return path if path.is_file() and os.access(path, os.R_OK) else None
