"""Server-sent events as OpenAI-compatible servers stream them: ``data: {...}`` blocks, ``[DONE]`` last."""

from __future__ import annotations

from tensora.gateway.upstream import UpstreamError

DONE = b"[DONE]"


class Events:
    """Splits a byte stream into the data payloads of its events (comments and other fields dropped).

    An event is held until its blank line comes: one longer than ``max_event`` bytes is the
    upstream's fault (``event_too_large``), not a buffer that grows without end."""

    __slots__ = ("_buf", "max_event")

    def __init__(self, max_event: int = 1 << 20) -> None:
        self._buf = b""
        self.max_event = max_event

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *blocks, self._buf = buf.split(b"\n\n")
        if len(self._buf) > self.max_event:
            self._buf = b""
            raise UpstreamError("event_too_large", f"an event over {self.max_event} bytes")
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
