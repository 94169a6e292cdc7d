"""The ``tensora`` command: ``common`` (the app, exit codes), ``local`` (this machine and offline
tools), ``cloud`` (the control API through the SDK), ``chat`` (an endpoint through the gateway)."""

from tensora.cli import chat, cloud, files, local
from tensora.cli.common import app


def main() -> None:
    app()


__all__ = ["app", "chat", "cloud", "files", "local", "main"]
