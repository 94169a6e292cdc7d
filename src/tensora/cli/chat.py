"""``tensora chat ENDPOINT``: talk to an endpoint through the region's gateway with the openai
client, streaming, and say what really answered.

Each answer's headers say what served it (``X-Tensora-Served-By``: replica, cpu, serverless,
fallback-model), whether the gateway counts that a fallback (``X-Tensora-Fallback``), the region,
and every backend tried in order with its outcome (``X-Tensora-Attempts``:
``chat/rp_1:connect_refused,chat/rp_2:ok``; a peer region is ``peer:<region>``). Two different
things make ``X-Tensora-Fallback: true``, and :func:`explain` tells them apart:

- the endpoint was *placed* on a fallback class (a CPU class: no GPU of its class was free), and its
  own replica there answered first time: nothing failed over;
- the request *failed over*: an earlier backend failed and another answered (a CPU replica, the
  serverless pool, a fallback model, another region).

The endpoint's placement (its requested class, each replica's class) comes from the control API
when the key may read it; without it the sentence says what the headers alone can.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

import typer

from tensora.cli.common import API_ERROR, TIMEOUT, UNREACHABLE, app, err, fail, out
from tensora.cli.profile import Target
from tensora.cli.root import session, target

OK = "ok"
OUTCOMES = {  # X-Tensora-Attempts outcomes (the gateway's upstream error kinds), in words
    "connect_refused": "connection refused", "connect_timeout": "connect timed out", "reset": "connection reset",
    "timeout": "no first token in time", "deadline": "the request's deadline passed",
    "bad_response": "a bad response", "stream_error": "a broken stream",
}


@dataclass(frozen=True, slots=True)
class Attempt:
    backend: str  # "<endpoint>/<replica>", or "peer:<region>"
    outcome: str  # "ok", or why it failed

    @property
    def replica(self) -> str:
        return self.backend.partition("/")[2] or self.backend

    @property
    def why(self) -> str:
        if self.outcome == "breaker_open":
            return "its circuit breaker is open"
        return f"HTTP {self.outcome[5:]}" if self.outcome.startswith("http_") else OUTCOMES.get(self.outcome,
                                                                                                 self.outcome)

    @property
    def said(self) -> str:
        """``chat/rp_1 failed (connection refused)``, ``chat/rp_1 was skipped (...)``."""
        if self.outcome == "breaker_open":
            return f"{self.backend} was skipped ({self.why})"
        return f"{self.backend} failed ({self.why})"


@dataclass(frozen=True, slots=True)
class Answered:
    """What the gateway's headers said about one answer (None: a header it did not send)."""

    served_by: str | None
    fallback: bool | None
    region: str | None
    model: str | None
    attempts: tuple[Attempt, ...] = ()


def parse_attempts(value: str | None) -> tuple[Attempt, ...]:
    """``a/rp_1:reset,peer:us:ok`` -> the attempts in order (the outcome follows the last colon)."""
    out = []
    for item in (value or "").split(","):
        backend, sep, outcome = item.strip().rpartition(":")
        if sep and backend and outcome:
            out.append(Attempt(backend, outcome))
    return tuple(out)


def read_headers(headers: Mapping[str, str], model: str | None) -> Answered:
    fallback = headers.get("x-tensora-fallback")
    return Answered(served_by=headers.get("x-tensora-served-by"),
                    fallback={"true": True, "false": False}.get(fallback or ""),
                    region=headers.get("x-tensora-region"), model=model,
                    attempts=parse_attempts(headers.get("x-tensora-attempts")))


@dataclass(frozen=True, slots=True)
class Placement:
    """The endpoint as the control API knows it: the class it asked for, and each replica's class."""

    requested: str
    replicas: Mapping[str, str] = field(default_factory=dict)  # replica id -> class


class Verdict(StrEnum):
    OWN = "own"  # its own replica answered first time, on the class it asked for (or one not known)
    PLACED_FALLBACK = "placed_fallback"  # its own replica answered first time, on a class it was placed on instead
    RETRIED = "retried"  # the backend that answered failed first, and answered when tried again (nothing else tried)
    FAILOVER = "failover"  # a backend failed (or was skipped) and another answered
    OTHER = "other"  # none of its own replicas was there to try; another backend answered
    UNKNOWN = "unknown"  # the headers do not say which backend answered


@dataclass(frozen=True, slots=True)
class Explained:
    verdict: Verdict
    text: str


def _placement_note(a: Answered, served: Attempt, placement: Placement | None) -> tuple[bool, str]:
    """(placed on a fallback class, the words for it) for the endpoint's own replica ``served``."""
    cls = placement.replicas.get(served.replica) if placement is not None else None
    on_cpu = a.served_by == "cpu"  # the gateway's word for a CPU replica of an endpoint that asked for a GPU
    if placement is not None and cls is not None:
        if cls == placement.requested:
            return False, f" on {cls}"
        what = "a CPU fallback" if on_cpu else "a class fallback"
        return True, f" (placed on {cls}, {what}: no {placement.requested} was free)"
    if on_cpu:
        return True, " (placed on a CPU class, a CPU fallback: no GPU of its class was free)"
    return False, ""


def _backend(a: Answered, served: Attempt, placement: Placement | None) -> tuple[bool, str]:
    """(placed on a fallback class, the words for the backend that answered)."""
    if served.backend.startswith("peer:"):
        region = a.region or served.backend.removeprefix("peer:")
        return False, f"region {region}'s gateway (its {a.served_by or 'backend'} answered there)"
    if a.served_by in ("replica", "cpu"):
        fell_back, note = _placement_note(a, served, placement)
        return fell_back, f"the endpoint's own replica {served.replica}{note}"
    if a.served_by == "serverless":
        return False, f"the serverless pool's model {a.model or '?'} (replica {served.replica})"
    if a.served_by == "fallback-model":
        return False, f"the fallback model {a.model or '?'} (replica {served.replica})"
    return False, f"{served.backend} ({a.served_by or 'served-by not said'})"


def failures(attempts: tuple[Attempt, ...]) -> str:
    """The attempts that did not answer, in words, in order: ``a failed (x), b was skipped (y)``; a backend tried
    again at once (the gateway's one retry of a tier's only replica) is named once: ``a failed (x, then y)``, or
    ``a failed twice (x)``."""
    said: list[tuple[str, list[Attempt]]] = []
    for x in attempts:
        if x.outcome == OK:
            continue
        skips = "breaker_open" in (x.outcome, said[-1][1][-1].outcome) if said else True
        if said and said[-1][0] == x.backend and not skips:
            said[-1][1].append(x)
        else:
            said.append((x.backend, [x]))
    return ", ".join(xs[0].said if len(xs) == 1 else f"{b} failed {_whys(xs)}" for b, xs in said)


def _whys(xs: list[Attempt]) -> str:
    """A backend's failures in a row: ``(x, then y)``, or ``twice (x)`` when they were the same."""
    whys = [x.why for x in xs]
    if len(set(whys)) == 1:
        return f"{'twice' if len(whys) == 2 else f'{len(whys)} times'} ({whys[0]})"
    return f"({', then '.join(whys)})"


def explain(a: Answered, placement: Placement | None = None) -> Explained:
    """The one true sentence about what answered: the endpoint's own replica first time (on the class
    it asked for, or on one it was placed on instead), or another backend after something failed."""
    served = a.attempts[-1] if a.attempts and a.attempts[-1].outcome == OK else None
    if served is None:
        return Explained(Verdict.UNKNOWN, "the gateway did not say which backend answered")
    fell_back, which = _backend(a, served, placement)
    before = a.attempts[:-1]
    if before and all(x.backend == served.backend for x in before):  # its retry of the same backend answered
        return Explained(Verdict.RETRIED, f"served by {which} when tried again, after it failed "
                                          f"({', then '.join(x.why for x in before)})")
    if before:
        return Explained(Verdict.FAILOVER, f"another backend answered: {which}, after {failures(before)}")
    own = a.served_by in ("replica", "cpu") and not served.backend.startswith("peer:")
    if not own:
        return Explained(Verdict.OTHER, f"another backend answered: {which}; "
                                        "none of the endpoint's own replicas was ready to try")
    return Explained(Verdict.PLACED_FALLBACK if fell_back else Verdict.OWN, f"served by {which}")


class Placements:
    """The endpoint's placement from the control API, read when an answer of its own replica needs it
    (once, and again only for a replica it has not seen); given up on for the session at the first
    error (a key without workloads:read, no control API reachable): the headers then speak alone."""

    def __init__(self, t: Target, endpoint: str) -> None:
        self.t, self.endpoint = t, endpoint
        self.known: Placement | None = None
        self.off = False

    def get(self, a: Answered) -> Placement | None:
        from tensora.sdk import APIError, Client

        served = a.attempts[-1] if a.attempts else None
        if self.off or served is None or served.backend.startswith("peer:") or a.served_by not in ("replica", "cpu"):
            return self.known
        if self.known is not None and served.replica in self.known.replicas:
            return self.known
        try:
            with Client(self.t.api_key, self.t.api_url, timeout=3.0, max_retries=0) as c:
                w = c.find_workload(self.endpoint)
        except (APIError, ValueError):
            self.off = True
            return self.known
        if w.kind != "endpoint":
            self.off = True
            return None
        self.known = Placement(w.requested_class, {r.id: r.class_ for r in w.replicas or []})
        return self.known


def _endpoint_name(ctx: typer.Context, ref: str) -> str:
    """The name (the model the gateway routes by) of the endpoint with id ``ref``."""
    with session(ctx) as c:
        w = c.find_workload(ref)
    if w.kind != "endpoint":
        raise fail(f"ENDPOINT: {ref} is a {w.kind}, not an endpoint")
    return w.name


def _served(headers: Any, model: str | None) -> str:
    by = headers.get("x-tensora-served-by", "?")
    fallback = headers.get("x-tensora-fallback", "?")
    region = headers.get("x-tensora-region", "?")
    return f"served by {by}, fallback {fallback}, region {region}, model {model or '?'}"


def _ask(client: Any, endpoint: str, messages: list[dict[str, str]], max_tokens: int,
         placements: Placements) -> str:
    """Stream one answer to stdout; what served it to stderr. Returns the answer's text."""
    text, model = "", None
    with client.chat.completions.with_streaming_response.create(
            model=endpoint, messages=messages, max_tokens=max_tokens, stream=True) as response:
        headers = response.headers
        for chunk in response.parse():
            model = chunk.model or model
            piece = (chunk.choices[0].delta.content or "") if chunk.choices else ""
            text += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    err.print(_served(headers, model), style="dim", markup=False)
    answered = read_headers(headers, model)
    said = explain(answered, placements.get(answered))
    if said.verdict is not Verdict.OWN:
        err.print(said.text, style="dim" if said.verdict is Verdict.UNKNOWN else "yellow", markup=False)
    return text


@app.command("chat", rich_help_panel="Use Tensora")
def chat_command(ctx: typer.Context,
                 endpoint: Annotated[str, typer.Argument(
                     help="the endpoint's name (the model in API calls) or id (wl_...)")],
                 message: Annotated[str | None, typer.Option("--message", "-m", help="ask this once and exit "
                                                             "(default: a conversation on stdin)")] = None,
                 system: Annotated[str | None, typer.Option(help="a system prompt")] = None,
                 max_tokens: Annotated[int, typer.Option(help="per answer")] = 256) -> None:
    """Chat with an endpoint through the gateway (streamed); says what served each answer: the
    endpoint's own replica (on a fallback class, if it was placed on one), or another backend after
    a failure."""
    try:
        import openai
    except ImportError:
        raise fail("tensora chat needs the openai package: pip install 'tensora[local]'") from None
    t = target(ctx)
    if not t.api_key:
        raise fail("no API key: set TENSORA_API_KEY, pass --api-key, or run tensora login")
    if endpoint.startswith("wl_"):
        endpoint = _endpoint_name(ctx, endpoint)
    client = openai.OpenAI(base_url=f"{t.gateway_url}/v1", api_key=t.api_key, max_retries=2, timeout=120)
    placements = Placements(t, endpoint)
    history = [{"role": "system", "content": system}] if system else []
    try:
        if message is not None:
            _ask(client, endpoint, [*history, {"role": "user", "content": message}], max_tokens, placements)
            return
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                out.print("[bold]you>[/bold] ", end="")
            line = sys.stdin.readline()
            if not line:
                return
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.rstrip("\n")})
            history.append({"role": "assistant", "content": _ask(client, endpoint, history, max_tokens, placements)})
    except openai.APITimeoutError:
        raise fail(f"the gateway at {t.gateway_url} did not answer in time", TIMEOUT) from None
    except openai.APIConnectionError:
        raise fail(f"cannot reach the gateway at {t.gateway_url} (is tensora up running?)", UNREACHABLE) from None
    except openai.APIStatusError as exc:
        detail = exc.body.get("message") if isinstance(exc.body, dict) else None
        rid = exc.response.headers.get("x-request-id")
        tried = failures(parse_attempts(exc.response.headers.get("x-tensora-attempts")))
        raise fail(f"{exc.status_code} {detail or exc.message}" + (f" ({tried})" if tried else "")
                   + (f" [request {rid}]" if rid else ""), API_ERROR) from None
    finally:
        client.close()
