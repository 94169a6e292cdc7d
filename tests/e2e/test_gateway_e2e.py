"""The gateway as users run it: ``tensora serve --driver local`` with a real model server (the tiny
model, uploaded to the owner's files, on transformers serve), ``tensora gateway`` in its own process,
the unmodified openai client.
Then the control API stops: the gateway keeps serving from its routes in memory, and from disk after
a restart of its own; the usage it metered meanwhile arrives once the control API is back, once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tensora.models.tinymodel import write_tiny_model
from tensora.models.validator import read_model
from tensora.sdk import Client
from tests.support.services import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen([sys.executable, "-m", "tensora.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, ok: Any = None, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and (ok is None or ok(r.json())):
                return
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _replica_pids(data: Path) -> list[int]:
    pids = []
    for f in (data / "replicas").glob("*/replica.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pids.append(int(json.loads(f.read_text())["pid"]))
    return pids


def _all_ended(data: Path) -> bool:
    """Every replica the local driver recorded has ended (stopped or failed)."""
    states = []
    for f in (data / "replicas").glob("*/replica.json"):
        with contextlib.suppress(OSError, ValueError):
            states.append(json.loads(f.read_text()).get("state"))
    return all(s in ("stopped", "failed") for s in states)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chat(key: str, gw_port: int) -> None:
    """``tensora chat``: one question, then a conversation on stdin; each answer says what served it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORA_")}
    env.update({"TENSORA_API_KEY": key, "TENSORA_GATEWAY_URL": f"http://127.0.0.1:{gw_port}"})
    served = "served by replica, fallback false, region local, model tiny-chat"
    once = subprocess.run([sys.executable, "-m", "tensora.cli", "chat", "tiny-chat", "-m", "hello", "--max-tokens",
                           "5"], capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert once.returncode == 0 and once.stdout.strip() and served in once.stderr, once.stderr
    talk = subprocess.run([sys.executable, "-m", "tensora.cli", "chat", "tiny-chat", "--max-tokens", "3"],
                          input="hello\n\nand again\n", capture_output=True, text=True, env=env, timeout=120)
    assert talk.returncode == 0 and talk.stderr.count(served) == 2, talk.stderr
    bad = subprocess.run([sys.executable, "-m", "tensora.cli", "chat", "no-such-endpoint", "-m", "hi"],
                         capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert bad.returncode == 1 and "404" in bad.stderr, bad.stderr


def test_the_gateway_serves_a_real_model_and_keeps_serving_without_the_control_api(tmp_path: Path) -> None:
    where = os.environ.get("TENSORA_RUNTIMES_DIR")
    if not where:
        pytest.skip("TENSORA_RUNTIMES_DIR is not set: ./scripts/test installs tensora-transformers there")
    write_tiny_model(tmp_path / "tiny")
    data = tmp_path / "data"
    (tmp_path / "serve.yaml").write_text("driver: local\ntick_s: 1\n"
                                         "node: {cpu: 4, memory: 16Gi, reserve_cpu: 0, reserve_memory: 0}\n")
    api_port, gw_port = free_port(), free_port()
    serve_args = ["serve", "--data-dir", str(data), "--port", str(api_port), "--config", str(tmp_path / "serve.yaml")]
    log = tmp_path / "serve.log"
    api = _start(serve_args, log)
    gw_log = tmp_path / "gateway.log"
    gw = None
    pids: list[int] = []
    try:
        _wait(f"http://127.0.0.1:{api_port}/readyz", api, log, lambda b: b.get("controller") == "leader")
        key = (data / "admin-key").read_text().strip()
        c = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", headers={"Authorization": f"Bearer {key}"},
                         timeout=10)
        with Client(key, f"http://127.0.0.1:{api_port}") as sdk:  # the model goes up first: model names it
            sdk.upload_dir(tmp_path / "tiny", "tiny")
        ep = c.post("/v1/workloads", json={"kind": "endpoint", "name": "tiny-chat", "gpu_class": "cpu-1c-4g",
                                           "model": "tiny"}).json()
        assert ep["model"] == "tiny" and ep["model_params"] == read_model(tmp_path / "tiny").params, ep
        gw_args = ["gateway", "--data-dir", str(data), "--port", str(gw_port),
                   "--control-url", f"http://127.0.0.1:{api_port}"]
        gw = _start(gw_args, gw_log)
        _wait(f"http://127.0.0.1:{gw_port}/healthz", gw, gw_log)
        deadline = time.monotonic() + 120
        while c.get(f"/v1/workloads/{ep['id']}").json()["state"] != "running":
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        pids = [int(json.loads(p.read_text())["pid"]) for p in (data / "replicas").glob("*/replica.json")]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key=key, max_retries=0, timeout=60)

        seen: list[int] = []  # completion tokens as the client was told

        def ask(n: int = 3) -> None:
            for _ in range(n):
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
                out = raw.parse()
                assert out.model == "tiny-chat" and out.usage is not None and out.usage.completion_tokens == 4
                assert raw.headers["x-tensora-served-by"] == "replica" and raw.headers["x-tensora-fallback"] == "false"
                seen.append(out.usage.completion_tokens)
            deltas, usage = [], None
            for chunk in client.chat.completions.create(model="tiny-chat", stream=True, max_tokens=5,
                                                        stream_options={"include_usage": True},
                                                        messages=[{"role": "user", "content": "hello"}]):
                assert chunk.model == "tiny-chat"
                deltas.extend(c.delta.content for c in chunk.choices if c.delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                    seen.append(usage)
            # five tokens generated and streamed, and the openai client saw the end ([DONE]: transformers
            # serve sends none). The number of deltas is the model server's (its streamer holds tokens
            # back until a word ends): a check of "at least five chunks" failed now and then, the cause
            # not pinned down; chunk-by-chunk forwarding is tested in test_gateway.py.
            assert usage == 5 and "".join(deltas), (usage, deltas)

        deadline = time.monotonic() + 20
        while True:  # the gateway picks the new replica up within poll_s
            with contextlib.suppress(openai.APIStatusError):
                ask(1)
                break
            assert time.monotonic() < deadline, gw_log.read_text()[-3000:]
            time.sleep(0.3)
        ask()
        assert [m.id for m in client.models.list()] == ["tiny-chat"]

        _stop(api)  # the control API goes away; the workload and the gateway stay
        ask()
        _stop(gw)  # and the gateway restarts with nobody to ask for routes: from its disk cache
        gw = _start(gw_args, gw_log)
        _wait(f"http://127.0.0.1:{gw_port}/healthz", gw, gw_log)
        ask()
        spooled = list((data / "gateway" / "spool").glob("*.jsonl"))
        assert spooled, "usage metered while the control API is down waits on disk"

        api = _start(serve_args, log)  # back: the spool drains, each request counted once
        _wait(f"http://127.0.0.1:{api_port}/readyz", api, log, lambda b: b.get("controller") == "leader")
        expected = 2 + 4 * 3  # the first round (one plain, one stream), then three of three plain and a stream
        deadline = time.monotonic() + 20
        while True:
            rows = c.get("/v1/usage/tokens").json()["data"]
            n = sum(r["requests"] for r in rows)
            if n >= expected:
                break
            assert time.monotonic() < deadline, (rows, gw_log.read_text()[-2000:])
            time.sleep(0.5)
        time.sleep(2)  # and nothing more arrives: no request is counted twice
        rows = c.get("/v1/usage/tokens").json()["data"]
        assert sum(r["requests"] for r in rows) == expected
        assert {(r["endpoint"], r["product"], r["model"], r["served_by"]) for r in rows} == {
            ("tiny-chat", "endpoint", "tiny-chat", "replica")}
        assert len(seen) == expected and sum(r["completion_tokens"] for r in rows) == sum(seen)
        chat(key, gw_port)  # last, so that its requests do not touch the counts above
        assert c.delete(f"/v1/workloads/{ep['id']}").status_code == 204
        deadline = time.monotonic() + 30  # the controller stops the replica (its sandbox and network with it)
        while not _all_ended(data):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        c.close()
    finally:
        if gw is not None:
            _stop(gw)
        _stop(api)
        for p in set(pids) | set(_replica_pids(data)):  # what a failure left running too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGKILL)
        for f in (data / "sandboxes").glob("bundles/*/pasta.pid"):  # a sandbox's network outlives its processes
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(f.read_text().split()[0]), signal.SIGKILL)
