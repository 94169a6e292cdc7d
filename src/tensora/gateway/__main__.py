"""``python -m tensora.gateway``: the gateway of ``tensora up``, its settings in TENSORA_GATEWAY_SETTINGS."""

from __future__ import annotations

import os
import signal


def main() -> None:
    from tensora.gateway.app import GATEWAY_SETTINGS_ENV, GatewaySettings, run

    settings = GatewaySettings.model_validate_json(os.environ[GATEWAY_SETTINGS_ENV])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # tensora up stops it (SIGTERM) after the API is down
    run(settings, quiet=True)


if __name__ == "__main__":
    main()
