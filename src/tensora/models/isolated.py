"""Reading an owner's model headers without risking the process that serves everyone else.

A safetensors header is JSON the owner wrote. ``json.loads`` holds the GIL for the whole parse and builds a
Python object per value: a 94 MiB header took seconds of CPU and about 1 GiB of memory, so a create with one
stalled every request of the API worker (a thread does not help: the GIL) and then the worker died. The cap
(:data:`~tensora.models.validator.MAX_HEADER_BYTES`) bounds the input; this module bounds the parse:

- headers of at most :data:`INLINE_HEADER_BYTES` altogether (every real model's shard: a few hundred KB) are
  parsed in the calling thread, a few milliseconds;
- anything larger is parsed in a child process (``python -I``, an empty environment) that first caps its own
  address space (``RLIMIT_AS``) and CPU time, and is killed past a wall-clock timeout. Whatever the child does,
  the API process only ever reads its small JSON answer, and at most :data:`MAX_CHILDREN` run at once.

Measured on a 2-core development machine: 1 MiB of header parses in about 40 ms (inline); a 16 MiB header of
120,000 tensors in 0.64 s and about 200 MiB; starting the child costs about 0.1 s.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tensora.errors import ModelFileError
from tensora.models import validator
from tensora.models.validator import ModelSize
from tensora.units import format_memory

INLINE_HEADER_BYTES = 1 << 20
"""Headers (and a shard index) up to this many bytes in all are parsed in the caller's thread."""

CHILD_MEMORY_BYTES = 1 << 30
"""The child's address-space limit: a 16 MiB header of the worst shape (tiny objects) fits in it."""

CHILD_TIMEOUT_S = 20.0
"""Wall-clock limit of a child's parse (its CPU time is capped at the same number of seconds)."""

MAX_CHILDREN = 2
"""Children one API process runs at once; further creates with large headers wait their turn."""

_slots = threading.BoundedSemaphore(MAX_CHILDREN)


def read_model(path: Path | str, *, inline_bytes: int = INLINE_HEADER_BYTES,
               memory_bytes: int = CHILD_MEMORY_BYTES, timeout_s: float = CHILD_TIMEOUT_S) -> ModelSize:
    """:func:`tensora.models.validator.read_model`, with a parse of more than ``inline_bytes`` of headers run
    in a child process under ``memory_bytes`` and ``timeout_s``. Raises ModelFileError as the validator does,
    also when the child runs out of either (naming the file and the budget)."""
    path = Path(path)
    if header_bytes(path, inline_bytes) <= inline_bytes:
        return validator.read_model(path)
    with _slots:
        return _in_child(path, memory_bytes, timeout_s)


def header_bytes(path: Path, enough: int) -> int:
    """The bytes of JSON :func:`validator.read_model` would parse for ``path`` (the 8-byte length of each
    file it would read, and a shard index's size), counting no further than past ``enough``. Reads 8 bytes per
    file; a file it cannot read counts nothing (the validator then says why)."""
    if path.is_file():
        return _declared(path)
    if not path.is_dir():
        return 0
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        size = indexes[0].stat().st_size
        if size > enough:
            return size
        try:
            shards = validator._shards_from_index(indexes[0])
        except ModelFileError:
            return size
    else:
        size, shards = 0, sorted(path.glob("*.safetensors"))
    for shard in shards:
        size += _declared(shard)
        if size > enough:
            break
    return size


def _declared(path: Path) -> int:
    """The header length the file declares; 0 for one the validator refuses without parsing (over the cap,
    longer than the file, unreadable)."""
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            file_size = os.fstat(f.fileno()).st_size
    except OSError:
        return 0
    if len(prefix) < 8:
        return 0
    (length,) = struct.unpack("<Q", prefix)
    return int(length) if length <= validator.MAX_HEADER_BYTES and 8 + length <= file_size else 0


_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from tensora.models.isolated import main; main(sys.argv[2:])"
_SRC = str(Path(__file__).resolve().parents[2])


def _in_child(path: Path, memory_bytes: int, timeout_s: float) -> ModelSize:
    env = {k: os.environ[k] for k in ("TENSORA_PURE",) if k in os.environ}  # nothing of the server's settings
    argv = [sys.executable, "-I", "-c", _BOOT, _SRC, str(path), str(memory_bytes), str(timeout_s)]
    try:
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ModelFileError(str(path), f"its headers took longer than {timeout_s:g} s to read") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and "error" in answer:
        raise ModelFileError(answer["error"]["path"], answer["error"]["message"])
    if done.returncode != 0 or not isinstance(answer, dict):
        # killed by a limit (CPU: SIGXCPU/SIGKILL), or a crash: the budget is what the owner can act on
        raise ModelFileError(str(path), f"its headers could not be read within {format_memory(memory_bytes)} of "
                                        f"memory and {timeout_s:g} s")
    return ModelSize(int(answer["params"]), int(answer["bytes"]), dict(answer["dtypes"]), tuple(answer["files"]))


def main(args: list[str]) -> None:
    """The child: cap itself, read the model, print one JSON answer (the size, or the error)."""
    path, memory_bytes, timeout_s = args[0], int(args[1]), float(args[2])
    cpu = max(1, int(timeout_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out: dict[str, Any]
    try:
        size = validator.read_model(path)
        out = {"params": size.params, "bytes": size.bytes, "dtypes": dict(size.dtypes), "files": list(size.files)}
    except ModelFileError as exc:
        out = {"error": {"path": exc.path, "message": exc.message}}
    except MemoryError:
        out = {"error": {"path": path, "message": f"its headers need more than {format_memory(memory_bytes)} of "
                                                  f"memory to read"}}
    sys.stdout.write(json.dumps(out))
