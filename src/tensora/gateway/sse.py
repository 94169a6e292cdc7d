"""Server-sent events as OpenAI-compatible servers stream them: ``data: {...}`` blocks, ``[DONE]`` last."""

from __future__ import annotations

DONE = b"[DONE]"


class Events:
    """Splits a byte stream into the data payloads of its events (comments and other fields dropped)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *blocks, self._buf = buf.split(b"\n\n")
        out = []
        for block in blocks:
            data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
        return out

    def tail(self) -> list[bytes]:
        """What is left when the stream ends without a blank line after its last event."""
        rest, self._buf = self._buf, b""
        return self.feed(rest + b"\n\n") if rest.strip() else []


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
