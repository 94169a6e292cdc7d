"""The quick start, run as written: the commands of its page in the docs, in order, against one `tensora up` on a
node declared as this machine's size (2 cores, 24 GiB), from a fresh HOME. It must end with a notebook URL that
answers, an endpoint that chats and a VM running, side by side. The README shows a copy of the same block: it must
stay identical to the page's."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import free_port, sweep

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorials" / "quick-start.md"
HEADING = "## 2. Create an endpoint, a notebook and a VM"  # the page's heading over the block this test runs
README = ROOT / "README.md"
HEADING_LINE = re.compile(r"#{1,6}\s+\S")


def sh_block_under(text: str, is_heading: Any) -> str | None:
    """The first ```sh block after the first heading line for which `is_heading` is true and before the next
    heading, or None: a missing heading or block says so rather than running whatever comes later."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if HEADING_LINE.match(ln) and is_heading(ln.strip())), None)
    if start is None:
        return None
    fence = None  # the fence that is open, if any
    block: list[str] = []
    for ln in lines[start + 1:]:
        if fence is None:
            if HEADING_LINE.match(ln):
                return None
            if ln.startswith("```"):
                fence = ln.strip()
        elif ln.startswith("```"):
            if fence == "```sh":
                return "\n".join(block) + "\n"
            fence = None
        elif fence == "```sh":
            block.append(ln)
    return None


def page_block() -> str:
    block = sh_block_under(PAGE.read_text(), lambda ln: ln == HEADING)
    assert block is not None, f"{PAGE}: no ```sh block under {HEADING!r}"
    return block


def quick_start_commands() -> list[str]:
    """The shell lines of the quick start page's block, comments dropped."""
    lines = []
    for raw in page_block().splitlines():
        if shlex.split(raw, comments=True):  # a command, not a comment line
            lines.append(re.sub(r"\s+#\s.*$", "", raw).strip())
    return lines


@pytest.mark.parametrize("text, want", [
    ("## Go\n\n```sh\nls\n```\n", "ls\n"),
    ("## Go\n```text\n# not a heading\n```\n```sh\nls\n# a comment\n```\n", "ls\n# a comment\n"),
    ("## Other\n```sh\nls\n```\n", None),
    ("## Go\ntext\n## Next\n```sh\nls\n```\n", None),
    ("## Go\n```sh\nls\n", None),
], ids=["block", "after-another-fence", "no-heading", "block-under-the-next-heading", "unclosed"])
def test_the_block_is_found_under_its_heading_only(text: str, want: str | None) -> None:
    assert sh_block_under(text, lambda ln: ln == "## Go") == want


def test_the_readme_shows_the_quick_start_of_the_docs_unchanged() -> None:
    readme = sh_block_under(README.read_text(), lambda ln: "quick start" in ln.lower())
    if readme is None:
        pytest.skip("the README has no ```sh block under a quick start heading")
    assert readme == page_block(), f"README.md's quick start block differs from {PAGE.relative_to(ROOT)}'s: copy it"


def test_the_quick_start_block_is_what_this_test_runs() -> None:
    lines = quick_start_commands()
    assert [ln.split()[:3] for ln in lines if ln.startswith("tensora up")] == [], "one `tensora up`: set-up command 1"
    kinds = [ln.split()[1] for ln in lines]
    assert {"login", "endpoint", "chat", "notebook", "vm"} <= set(kinds), lines
    assert "runtime" not in kinds, "no install step: the first endpoint installs its runtime (tensora up)"
    assert not any("/.local/share" in ln or "--key-file" in ln for ln in lines), "no hard-coded data path"


def _wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).json().get("controller") == "leader":
                return
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_the_quick_start_runs_as_written_on_a_2_core_24_gib_node(tmp_path: Path) -> None:
    if not os.environ.get("TENSORA_RUNTIMES_DIR"):
        pytest.skip("TENSORA_RUNTIMES_DIR is not set: ./scripts/test installs tensora-transformers there")
    home, data, work = tmp_path / "home", tmp_path / "home" / "data", tmp_path / "work"
    for d in (home, work):
        d.mkdir(parents=True)
    port, gw_port = free_port(), free_port()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "TENSORA_DATA_DIR": str(data),
           "TENSORA_API_URL": f"http://127.0.0.1:{port}", "TENSORA_GATEWAY_URL": f"http://127.0.0.1:{gw_port}",
           "COLUMNS": "80", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for k in ("TENSORA_API_KEY", "TENSORA_PROFILE"):
        env.pop(k, None)
    # this machine's size, declared: what a newcomer's 2-core, 24 GiB machine offers by default
    (tmp_path / "up.yaml").write_text("node: {cpu: 2, memory: 24Gi, gpus: {}}\ntick_s: 1\n")
    log = tmp_path / "up.log"
    with log.open("wb") as f:
        up = subprocess.Popen([sys.executable, "-m", "tensora.cli", "up", "--port", str(port),
                               "--gateway-port", str(gw_port), "--config", str(tmp_path / "up.yaml")],
                              stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    outputs: dict[str, str] = {}
    try:
        _wait_ready(port, up, log)
        for line in quick_start_commands():
            started = time.monotonic()
            done = subprocess.run(line, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=300,
                                  stdin=subprocess.DEVNULL)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}\n--- tensora up:\n{log.read_text()}"
            outputs[line.split()[1]] = done.stdout + done.stderr
            print(f"{time.monotonic() - started:6.1f}s  {line}")
        assert "served by" in outputs["chat"], outputs["chat"]
        url = re.search(r"http://127\.\d+\.\d+\.\d+:\d+/lab\?token=\S+", outputs["notebook"])
        assert url is not None, outputs["notebook"]
        assert httpx.URL(url.group(0)).host != "127.0.0.1"  # an address of its own, not the dashboard's host
        assert httpx.get(url.group(0), timeout=10).status_code == 200
        key = (data / "admin-key").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}) as c:
            listed: list[dict[str, Any]] = c.get("/v1/workloads").json()["data"]
        states = {w["kind"]: w["state"] for w in listed}
        assert states == {"endpoint": "running", "notebook": "running", "vm": "running"}, listed
        assert "ERROR" not in log.read_text() and "unreachable" not in log.read_text(), log.read_text()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.wait(timeout=30)
        if up.poll() is None:
            up.kill()
        sweep(data)  # the replicas outlive tensora up by design: delete their sandboxes

