"""Per-replica API keys: a model server on the local driver answers only to the gateway.

A replica's key is derived, never stored: ``HMAC-SHA256(secret, replica id)`` in hex, where ``secret`` is
32 random bytes in ``DATA_DIR/replica-key-secret`` (0600, made once). The local driver starts a runtime that
takes a key (``Runtime.api_key_env``) with it in its environment, never on its argv; the control API puts it
in the gateway's route table (admin keys only); the gateway sends it upstream as ``Authorization: Bearer``.
No tenant holds it: another tenant's notebook that reaches the server's port gets 401.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_FILE = "replica-key-secret"
SECRET_BYTES = 32


def derive(secret: bytes, replica_id: str) -> str:
    """The replica's API key: the same for the same secret and replica, unguessable without the secret. Pure."""
    return hmac.new(secret, replica_id.encode(), hashlib.sha256).hexdigest()


def ensure_secret(data_dir: Path) -> bytes:
    """The secret in ``data_dir``, made on first use (0600). Safe when several processes start at once:
    the file appears whole (a hard link of a finished temp file) and the first one made wins."""
    path = Path(data_dir) / SECRET_FILE
    with contextlib.suppress(FileNotFoundError):
        return _read(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def _read(path: Path) -> bytes:
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"{path} is not a replica key secret ({len(secret)} bytes, want {SECRET_BYTES}): "
                         "remove it to make a new one (running model servers then need a restart)")
    return secret
