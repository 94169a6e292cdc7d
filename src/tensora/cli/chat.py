"""``tensora chat ENDPOINT``: talk to an endpoint through the region's gateway with the openai
client, streaming, and say what really answered (served-by, fallback, region, model)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from tensora.cli.cloud import target
from tensora.cli.common import API_ERROR, TIMEOUT, UNREACHABLE, app, err, fail, out


def _served(headers: Any, model: str | None) -> str:
    by = headers.get("x-tensora-served-by", "?")
    fallback = headers.get("x-tensora-fallback", "?")
    region = headers.get("x-tensora-region", "?")
    return f"served by {by}, fallback {fallback}, region {region}, model {model or '?'}"


def _ask(client: Any, endpoint: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    """Stream one answer to stdout; the served-by line to stderr. Returns the answer's text."""
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
    err.print(f"[dim]{_served(headers, model)}[/dim]")
    if headers.get("x-tensora-fallback") == "true":
        err.print("[yellow]a fallback answered: the endpoint's own replicas could not[/yellow]")
    return text


@app.command("chat", rich_help_panel="Use Tensora")
def chat_command(ctx: typer.Context,
                 endpoint: Annotated[str, typer.Argument(help="the endpoint's name (the model in API calls)")],
                 message: Annotated[str | None, typer.Option("--message", "-m", help="ask this once and exit "
                                                             "(default: a conversation on stdin)")] = None,
                 system: Annotated[str | None, typer.Option(help="a system prompt")] = None,
                 max_tokens: Annotated[int, typer.Option(help="per answer")] = 256) -> None:
    """Chat with an endpoint through the gateway (streamed); shows what served each answer."""
    try:
        import openai
    except ImportError:
        raise fail("tensora chat needs the openai package: pip install 'tensora[local]'") from None
    t = target(ctx)
    if not t.api_key:
        raise fail("no API key: set TENSORA_API_KEY, pass --api-key, or run tensora login")
    client = openai.OpenAI(base_url=f"{t.gateway_url}/v1", api_key=t.api_key, max_retries=2, timeout=120)
    history = [{"role": "system", "content": system}] if system else []
    try:
        if message is not None:
            _ask(client, endpoint, [*history, {"role": "user", "content": message}], max_tokens)
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
            history.append({"role": "assistant", "content": _ask(client, endpoint, history, max_tokens)})
    except openai.APITimeoutError:
        raise fail(f"the gateway at {t.gateway_url} did not answer in time", TIMEOUT) from None
    except openai.APIConnectionError:
        raise fail(f"cannot reach the gateway at {t.gateway_url} (is tensora up running?)", UNREACHABLE) from None
    except openai.APIStatusError as exc:
        detail = exc.body.get("message") if isinstance(exc.body, dict) else None
        rid = exc.response.headers.get("x-request-id")
        raise fail(f"{exc.status_code} {detail or exc.message}" + (f" [request {rid}]" if rid else ""),
                   API_ERROR) from None
    finally:
        client.close()
