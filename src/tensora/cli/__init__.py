"""The ``tensora`` command: ``common`` (the app, exit codes), ``root`` (the options and session of the commands over
the control API, through the SDK), one module per command group over it (``create``, ``workloads``, ``catalog``,
``usage``, ``keys``, ``owners``, ``login``, ``files``), ``chat`` (an endpoint through the gateway) and ``local``
(this machine and offline tools). Imported in the order ``tensora --help`` lists them."""

from tensora.cli import root  # isort: skip  (the global options first)
from tensora.cli import create, workloads, catalog, usage, keys, owners, login  # isort: skip
from tensora.cli import chat, files, local  # isort: skip
from tensora.cli.common import app, reflow_help

reflow_help(app)


def main() -> None:
    app()


__all__ = ["app", "catalog", "chat", "create", "files", "keys", "local", "login", "main", "owners", "root", "usage",
           "workloads"]
