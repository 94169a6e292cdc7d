"""Malformed inference bodies are the caller's mistake: a 400 in OpenAI's error shape naming the field, never
a 500 and never a traceback in the log. What the gateway merely passes on is left to the model server."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora.gateway.body import Body, Invalid, parse
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.keys import apikeys
from tests.support.gateway_harness import Backends, make_table, replica, serving

pytestmark = pytest.mark.timeout(120)

KEY = apikeys.generate()


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "my-llm", "messages": [{"role": "user", "content": "hello"}], **kw}


def msg(content: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": content}])


# name -> (body: a JSON value, or raw bytes as sent; the param named, or None for the body as a whole)
MALFORMED: dict[str, tuple[Any, str | None]] = {
    "a content part's text is a number": (chat(messages=[{"role": "user", "content": [{"text": 5}]}]),
                                          "messages.[0].content.[0].text"),
    "messages is a string": (chat(messages="x"), "messages"),
    "a message is a number": (chat(messages=[5]), "messages.[0]"),
    "content is a number": (msg(5), "messages.[1].content"),
    "content is an object": (msg({"text": "hi"}), "messages.[1].content"),
    "a content part is a string": (msg(["hi"]), "messages.[1].content.[0]"),
    "a later part's text is a list": (msg([{"type": "text", "text": "a"}, {"type": "text", "text": ["b"]}]),
                                      "messages.[1].content.[1].text"),
    "max_tokens is a string": (chat(max_tokens="a"), "max_tokens"),
    "max_tokens is a boolean": (chat(max_tokens=True), "max_tokens"),
    "max_tokens is a fraction": (chat(max_tokens=1.5), "max_tokens"),
    "max_tokens is 0": (chat(max_tokens=0), "max_tokens"),
    "max_completion_tokens is negative": (chat(max_completion_tokens=-3), "max_completion_tokens"),
    "stream is 3": (chat(stream=3), "stream"),
    "stream is a string": (chat(stream="true"), "stream"),
    "stream_options is a list": (chat(stream=True, stream_options=[1]), "stream_options"),
    "include_usage is a string": (chat(stream=True, stream_options={"include_usage": "yes"}),
                                  "stream_options.include_usage"),
    "n is -1": (chat(n=-1), "n"),
    "n is a string": (chat(n="2"), "n"),
    "best_of is 0": ({"model": "my-llm", "prompt": "x", "best_of": 0}, "best_of"),
    "prompt is an object": ({"model": "my-llm", "prompt": {"a": 1}}, "prompt"),
    "prompt holds an object": ({"model": "my-llm", "prompt": ["a", {}]}, "prompt"),
    "prompt holds a list of strings": ({"model": "my-llm", "prompt": [["a"]]}, "prompt"),
    "model is a number": (chat(model=5), "model"),
    "model is empty": (chat(model=""), "model"),
    "no model": ({"messages": []}, "model"),
    "the body is an array": ([chat()], None),
    "the body is a string": ("x", None),
    "the body is null": (None, None),
    "the body is not JSON": (b"{nope", None),
    "the body is not UTF-8": (b'{"model": "\xff"}', None),
}

# what the gateway does not read passes on as it came, for the model server to judge
PASSED_ON: dict[str, dict[str, Any]] = {
    "fields it does not read, of any type": chat(temperature="hot", tools=5, user=["x"], logit_bias=None),
    "a message's role and tool calls unread": chat(messages=[{"role": 7, "content": None, "tool_calls": 3}]),
    "an image part without text": msg([{"type": "image_url", "image_url": {"url": "data:,"}},
                                       {"type": "text", "text": "what is it?"}]),
    "nulls where null is allowed": chat(stream=None, stream_options=None, max_tokens=None, n=None),
    "a prompt of token ids": {"model": "my-llm", "prompt": [[1, 2, 3], [4]], "max_tokens": 2},
    "a prompt of strings": {"model": "my-llm", "prompt": ["once", "upon"], "n": 2, "best_of": 3},
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    backends = Backends(["r1"])
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], {KEY: ("alice", ["inference"])})
    try:
        with serving(Gateway(Options(ttft_s=2, deadline_s=5), lambda: table, MemoryLimiter(), None)) as u:
            yield u
    finally:
        backends.close()


def send(url: str, body: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(f"{url}/chat/completions", content=raw, timeout=10,
                      headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})


@pytest.mark.parametrize(("body", "param"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_body_is_a_400_naming_the_field(url: str, body: Any, param: str | None,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tensora.gateway")
    r = send(url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if param is not None:
        assert param in err["message"]
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


@pytest.mark.parametrize("body", PASSED_ON.values(), ids=PASSED_ON.keys())
def test_what_the_gateway_does_not_read_is_passed_on(url: str, body: dict[str, Any]) -> None:
    r = send(url, body)
    assert r.status_code == 200, r.text


# -- the reservation, pure ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reserve:
    body: dict[str, Any]
    want: int


RESERVES = {
    "no max_tokens -> the default": Reserve({"model": "m"}, 1 + 100),
    "a message: its characters / 4 + 16 for its framing": Reserve(
        {"model": "m", "messages": [{"content": "x" * 48}], "max_tokens": 10}, 16 + 1 + 10),
    "text parts counted, others not": Reserve(
        {"model": "m", "messages": [{"content": [{"text": "x" * 20}, {"type": "image_url"}, {"text": "y" * 8}]}],
         "max_tokens": 1}, 11 + 1 + 1),
    "max_completion_tokens over max_tokens": Reserve({"model": "m", "max_tokens": 5, "max_completion_tokens": 9},
                                                     1 + 9),
    "n answers reserve n times": Reserve({"model": "m", "n": 3, "max_tokens": 10}, 1 + 30),
    "best_of more than n": Reserve({"model": "m", "n": 2, "best_of": 4, "max_tokens": 10}, 1 + 40),
    "token ids count one each": Reserve({"model": "m", "prompt": [[1, 2, 3], [4]], "max_tokens": 1}, 4 + 1 + 1),
}


@pytest.mark.parametrize("case", RESERVES.values(), ids=RESERVES.keys())
def test_reservation(case: Reserve) -> None:
    got = parse(case.body, 100)
    assert isinstance(got, Body) and got.reserve == case.want


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=4), max_leaves=20)
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
          "best_of", "content", "text", "include_usage"]
near_bodies = st.recursive(json_values, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=6), max_leaves=30)


@given(obj=near_bodies)
def test_any_json_is_read_or_named_never_an_exception(obj: Any) -> None:
    got = parse(obj, 256)
    if isinstance(got, Invalid):
        assert got.message and (got.param is None or got.param == "model" or got.param.split(".")[0] in obj)
    else:
        assert isinstance(got.reserve, int) and got.reserve >= 1 and got.obj is obj
