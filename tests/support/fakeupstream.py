"""An in-memory upstream for unit tests of the walk and the relay: what ``upstream.Upstream`` promises, played
from a script per backend URL, with no sockets and no processes. For whole servers that misbehave over real
HTTP, see ``fakebackend``."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from tensora.gateway.upstream import Reply, Upstream, UpstreamError


@dataclass
class Step:
    """One answer to one POST: ``error`` raised instead (an ``UpstreamError`` kind); ``stall``: no head at all
    (the POST times out as the real client does); ``chunks``: a body that comes in pieces, ``None`` among them
    meaning the stream goes silent there for good."""

    status: int = 200
    body: bytes = b""
    headers: dict[bytes, bytes] = field(default_factory=dict)
    chunks: list[bytes | None] | None = None
    error: str | None = None
    stall: bool = False


def ok(content: str = "hi", prompt_tokens: int = 3, completion_tokens: int = 1) -> Step:
    return Step(body=orjson.dumps({"object": "chat.completion", "model": "upstream",
                                   "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                                "finish_reason": "stop"}],
                                   "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}))


def status(code: int, **headers: str) -> Step:
    return Step(code, orjson.dumps({"error": {"message": f"failed with {code}", "type": "server_error"}}),
                {k.replace("_", "-").encode(): v.encode() for k, v in headers.items()})


def sse(*events: Mapping[str, Any] | None, done: bool = True) -> Step:
    """A stream of these events (``None``: it stalls there), then ``[DONE]`` unless it stalled."""
    chunks: list[bytes | None] = [None if e is None else b"data: " + orjson.dumps(e) + b"\n\n" for e in events]
    if done and None not in chunks:
        chunks.append(b"data: [DONE]\n\n")
    return Step(chunks=chunks)


class FakeReply:
    def __init__(self, step: Step) -> None:
        self.status = step.status
        self._headers = step.headers
        self._chunks: deque[bytes | None] = deque(step.chunks if step.chunks is not None else [step.body])
        self._stalls = step.chunks is not None and None in step.chunks
        self.released = False

    def header(self, name: bytes) -> bytes | None:
        return self._headers.get(name)

    async def next_chunk(self) -> bytes | None:
        if not self._chunks:
            return None
        chunk = self._chunks.popleft()
        if chunk is None:  # silent from here on
            await asyncio.Event().wait()
        return chunk

    async def read(self) -> bytes:
        return b"".join([c for c in self._chunks if c is not None])

    def ready(self) -> bool:
        return not self._chunks or self._chunks[0] is not None

    def read_now(self) -> bytes | None:
        return None if self._stalls else b"".join([c for c in self._chunks if c is not None])

    def release(self) -> None:
        self.released = True


class FakeUpstream:
    """``script``: base URL -> the answers to its POSTs in turn (once they run out, ``ok()``). ``posts``: what
    was sent, as (base URL, path, JSON body, headers)."""

    def __init__(self, script: dict[str, list[Step]]) -> None:
        self.script = {url: deque(steps) for url, steps in script.items()}
        self.posts: list[tuple[str, str, dict[str, object], list[tuple[str, str]]]] = []

    async def post(self, base_url: str, path: str, body: bytes, headers: list[tuple[str, str]],
                   head_timeout: float, meanwhile: Callable[[], None] | None = None) -> FakeReply:
        self.posts.append((base_url, path, orjson.loads(body), headers))
        if meanwhile is not None:  # as the client does: the request is out, its answer not yet in
            meanwhile()
        steps = self.script.get(base_url)
        step = steps.popleft() if steps else ok()
        if step.error is not None:
            raise UpstreamError(step.error)
        if step.stall:
            await asyncio.sleep(head_timeout)
            raise UpstreamError("timeout", "no response in time")
        return FakeReply(step)

    def close(self) -> None:
        pass


if TYPE_CHECKING:  # mypy holds the doubles to the protocols they fake (tests/support is type-checked)
    _upstream: type[Upstream] = FakeUpstream
    _reply: type[Reply] = FakeReply
