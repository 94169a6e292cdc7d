"""QMP, QEMU's machine protocol: how the local driver asks a VM whether it runs and tells it to stop."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any


def qmp(path: str, *commands: dict[str, Any], timeout: float = 2.0) -> list[Any]:
    """Run QMP commands on a VM's socket; their ``return`` values (an error raises OSError).

    A path longer than a socket address allows (a data dir deep in the tree) is reached through its dir's
    descriptor (``/proc/self/fd/N/name``)."""
    with contextlib.ExitStack() as stack, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        if len(os.fsencode(path)) > 100:
            fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
            stack.callback(os.close, fd)
            path = f"/proc/self/fd/{fd}/{os.path.basename(path)}"
        s.connect(path)
        f = s.makefile("rwb")
        json.loads(f.readline())  # the greeting
        out = []
        for cmd in ({"execute": "qmp_capabilities"}, *commands):
            f.write(json.dumps(cmd).encode() + b"\n")
            f.flush()
            while True:
                msg = json.loads(f.readline() or b"{}")
                if not msg:
                    raise OSError("QMP closed the connection")
                if "event" in msg:
                    continue
                if "error" in msg:
                    raise OSError(f"QMP {cmd['execute']}: {msg['error'].get('desc')}")
                out.append(msg.get("return"))
                break
        return out[1:]
