"""What the gateway reads of an inference body, checked: a malformed body is a 400 naming the field.

The gateway reads only what it needs (``model``, ``stream`` and ``stream_options.include_usage``,
what it reserves tokens for: ``messages`` / ``prompt``, ``max_tokens`` / ``max_completion_tokens``, ``n``
/ ``best_of``) and checks exactly that, as OpenAI would: ``"stream": 3`` or a content part whose
``text`` is a number is the caller's mistake, never a 500 here. Every other field (``temperature``,
``tools``, ``role``...) passes through unread for the model server to judge, so the gateway never refuses
what a runtime accepts. Fields are named as OpenAI names them: ``messages.[0].content.[1].text``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, init=False)  # made once a request: see ``call.Call`` for why the __init__ of its own
class Body:
    obj: dict[str, Any]  # as it came; passed upstream with ``model`` replaced
    model: str
    stream: bool
    include_usage: bool  # a stream whose client asked for the usage chunk
    reserve: int  # tokens to reserve at admission: the prompt estimate + what the answers may take
    least: int = 0  # a lower bound on the context it needs: the prompt at 8 characters a token + max_tokens

    def __init__(self, obj: dict[str, Any], model: str, stream: bool, include_usage: bool, reserve: int,
                 least: int = 0) -> None:
        self.obj, self.model, self.stream, self.include_usage, self.reserve, self.least = \
            obj, model, stream, include_usage, reserve, least


@dataclass(frozen=True, slots=True)
class Invalid:
    message: str
    param: str | None  # the field, as OpenAI names it; None: the body as a whole
    code: str = "invalid_type"


def parse(obj: Any, default_max_tokens: int) -> Body | Invalid:
    """``obj`` (a parsed JSON body) checked and read, or what is wrong with it; pure."""
    if not isinstance(obj, dict):
        return Invalid("the body must be a JSON object", None)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        return _type("model", "a string: an endpoint's name", model)
    if not model:
        return Invalid("model is required: an endpoint's name", "model", "missing_model")
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return _type("stream", "a boolean", stream)
    include_usage = False
    opts = obj.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            return _type("stream_options", "an object", opts)
        usage = opts.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            return _type("stream_options.include_usage", "a boolean", usage)
        include_usage = usage is True and stream is True
    chars = 0
    msgs = obj.get("messages")
    if msgs is not None:
        if not isinstance(msgs, list):
            return _type("messages", "an array of messages", msgs)
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                return _type(f"messages.[{i}]", "an object", m)
            c = m.get("content")
            if isinstance(c, str):
                chars += len(c) + 16
            elif isinstance(c, list):
                for j, part in enumerate(c):
                    if not isinstance(part, dict):
                        return _type(f"messages.[{i}].content.[{j}]", "an object", part)
                    text = part.get("text")
                    if isinstance(text, str):
                        chars += len(text)
                    elif text is not None:
                        return _type(f"messages.[{i}].content.[{j}].text", "a string", text)
                chars += 16
            elif c is not None:
                return _type(f"messages.[{i}].content", "a string or an array of content parts", c)
    prompt = obj.get("prompt")
    if prompt is not None:
        n = _prompt_chars(prompt)
        if n is None:
            return _type("prompt", "a string, an array of strings or an array of token ids", prompt)
        chars += n
    most = obj.get("max_completion_tokens") or obj.get("max_tokens")
    if "max_tokens" in obj or "max_completion_tokens" in obj:
        for name in ("max_completion_tokens", "max_tokens"):
            if (bad := _count(obj, name)) is not None:
                return bad
    answers = 1
    if "n" in obj or "best_of" in obj:
        for name in ("n", "best_of"):
            if (bad := _count(obj, name)) is not None:
                return bad
        answers = max(obj.get("n") or 1, obj.get("best_of") or 1)
    # ``least``: few tokenizers give a token more than 8 characters on average, so a prompt of that many
    # characters needs at least chars / 8 tokens; a model server refuses prompt + max_tokens past its context
    return Body(obj, model, stream is True, include_usage, chars // 4 + 1 + answers * (most or default_max_tokens),
                chars // 8 + (most or 0))


def _count(obj: dict[str, Any], name: str) -> Invalid | None:
    """What is wrong with ``obj[name]`` as a count (null or an integer of at least 1), if anything."""
    v = obj.get(name)
    if v is None:
        return None
    if not _is_int(v):
        return _type(name, "an integer", v)
    if v < 1:
        return Invalid(f"{name} must be at least 1, not {v}", name, "invalid_value")
    return None


def _prompt_chars(p: Any) -> int | None:
    """Characters of a prompt (a token id counted as 4), or None when it is no prompt."""
    if isinstance(p, str):
        return len(p)
    if not isinstance(p, list):
        return None
    n = 0
    for x in p:
        if isinstance(x, str):
            n += len(x)
        elif _is_int(x):
            n += 4
        elif isinstance(x, list) and all(_is_int(t) for t in x):
            n += 4 * len(x)
        else:
            return None
    return n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type(param: str, what: str, got: Any) -> Invalid:
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(got), type(got).__name__)
    return Invalid(f"{param} must be {what}, not {kind}", param)
