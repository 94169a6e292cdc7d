"""Model size from safetensors headers only: parameters, bytes, dtypes; and the CPU limit.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``), then
the tensor data. Only the header is read, never the weights. Every header is treated
as hostile: its length is capped before anything is allocated, the JSON must be an
object of well-formed entries, each tensor's byte range must match its dtype and
shape and lie inside the file. A model directory is sharded (``*.safetensors.index.json``
naming the shards) or a set of ``*.safetensors`` files.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tensora.errors import ModelFileError
from tensora.units import format_memory, format_params

MAX_HEADER_BYTES = 16 * 2**20
"""The largest header (and shard index) read: 16 MiB. Real headers take about 100 bytes per tensor, a few
hundred KB per shard and a few MB for the largest single-file models; 16 MiB is about 120,000 tensors. The
format's own limit (100 MB) is far more than one request may make the API parse: 94 MiB took seconds and about
1 GiB of memory (``tensora.models.isolated`` bounds the parse itself)."""

DEFAULT_CPU_PARAM_LIMIT = 8.5e9
"""Endpoints with more parameters than this are never placed on a CPU class (8B-class models pass)."""

DTYPE_BYTES: Mapping[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
    "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}


@dataclass(frozen=True, slots=True)
class ModelSize:
    """What a model's headers say: parameters (elements of all tensors), data bytes, params per dtype."""

    params: int
    bytes: int
    dtypes: Mapping[str, int] = field(default_factory=dict)
    files: tuple[str, ...] = ()

    def describe(self) -> str:
        kinds = ", ".join(sorted(self.dtypes))
        return f"{format_params(self.params)} params, {format_memory(self.bytes)} ({kinds})"


@dataclass(frozen=True, slots=True)
class CpuVerdict:
    """Whether a model may be served on a CPU class, and why."""

    allowed: bool
    params: int
    bytes: int
    limit: float

    @property
    def reason(self) -> str:
        size = f"{format_params(self.params)} params, {format_memory(self.bytes)}"
        relation = "<=" if self.allowed else ">"
        return f"{size}: {relation} the CPU limit of {format_params(self.limit)} params"


def check_cpu(size: ModelSize, limit: float = DEFAULT_CPU_PARAM_LIMIT) -> CpuVerdict:
    """Is ``size`` under the CPU size limit (in parameters)? Bytes are reported beside it."""
    return CpuVerdict(size.params <= limit, size.params, size.bytes, limit)


def read_file(path: Path | str) -> ModelSize:
    """The size of one ``.safetensors`` file, from its header alone."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            file_size = f.tell()
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelFileError(str(path), f"truncated: {len(prefix)} bytes, a safetensors file starts with 8")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise ModelFileError(str(path), f"header length {length} exceeds the "
                                                f"{format_memory(MAX_HEADER_BYTES)} cap on safetensors headers")
            if 8 + length > file_size:
                raise ModelFileError(str(path), f"truncated: header says {length} bytes, file has {file_size - 8}")
            raw = f.read(length)
    except OSError as exc:
        raise ModelFileError(str(path), f"cannot read: {exc.strerror or exc}") from None
    return _parse_header(str(path), raw, file_size - 8 - length)


def _parse_header(where: str, raw: bytes, data_size: int) -> ModelSize:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelFileError(where, f"not a safetensors file: header is not JSON ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise ModelFileError(where, "not a safetensors file: header is not a JSON object")
    params, total = 0, 0
    dtypes: dict[str, int] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict):
                raise ModelFileError(where, "__metadata__ must be an object")
            continue
        if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"}:
            raise ModelFileError(where, f"tensor {name!r}: expected {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise ModelFileError(where, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 16:
            raise ModelFileError(where, f"tensor {name!r}: shape must be a list of non-negative integers")
        if (
            not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelFileError(where, f"tensor {name!r}: data_offsets must be [begin, end] with begin <= end")
        begin, end = offsets
        if end > data_size:
            raise ModelFileError(where, f"tensor {name!r}: data_offsets [{begin}, {end}] out of range "
                                        f"(data is {data_size} bytes)")
        count = math.prod(shape)
        expected = math.ceil(count * DTYPE_BYTES[dtype])
        if end - begin != expected:
            raise ModelFileError(where, f"tensor {name!r}: {end - begin} bytes for {dtype} {shape}, "
                                        f"expected {expected}")
        ranges.append((begin, end, name))
        params += count
        total += end - begin
        dtypes[dtype] = dtypes.get(dtype, 0) + count
    ranges.sort()
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(ranges):
        if begin_b < end_a:
            raise ModelFileError(where, f"tensors {name_a!r} and {name_b!r} overlap")
    return ModelSize(params, total, dtypes, (where,))


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a Hugging Face ``config.json`` says how many tokens the model takes (prompt and answer together)."""


def read_context(path: Path | str) -> int | None:
    """The context length the model's ``config.json`` states (a model directory's, or a single file's
    neighbour: None when there is none, or it says nothing usable). The gateway uses it to send a prompt
    too long for a model to a fallback model that can take it. Never follows a symlink, reads at most
    1 MiB, and never fails: a config it cannot read is one it does not know."""
    path = Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    try:
        fd = os.open(config, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for part in (data, data.get("text_config")):  # multimodal configs keep it under text_config
        if isinstance(part, dict):
            for k in CONTEXT_KEYS:
                v = part.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 24:
                    return v
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Either is a tokenizer a model server can load (``tensora dev tiny-model`` writes both)."""


def missing_for_serving(path: Path | str) -> str | None:
    """What a model server (vLLM, transformers, MLX) lacks to load the model at ``path``, as the end of a sentence
    about it, or None when nothing is. It loads a directory: its ``config.json`` (the architecture and sizes the
    weights are read by), a tokenizer and the weights; a lone safetensors file is none of that (the launcher
    mounts only the model's own path at ``/model``). Reads nothing, only looks for the files."""
    path = Path(path)
    if not path.is_dir():
        return ("is a single file: the model server needs a model directory (config.json, a tokenizer and the "
                "safetensors weights); upload the whole directory, such as `tensora dev tiny-model` writes")
    if not (path / "config.json").is_file():
        return "has no config.json: the model server needs it (the architecture and sizes of the weights)"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"has no tokenizer ({' or '.join(TOKENIZER_FILES)}): the model server needs it"
    return None


def read_model(path: Path | str) -> ModelSize:
    """The size of a model: one safetensors file, or a directory (sharded with an index, or plain)."""
    path = Path(path)
    if path.is_file():
        return read_file(path)
    if not path.is_dir():
        raise ModelFileError(str(path), "no such file or directory")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    shards = _shards_from_index(indexes[0]) if indexes else sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(str(path), "no .safetensors files in this directory")
    return _combine([read_file(s) for s in shards])


def _shards_from_index(index: Path) -> list[Path]:
    try:
        with index.open("rb") as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
        if len(raw) > MAX_HEADER_BYTES:
            raise ModelFileError(str(index), f"index exceeds the {format_memory(MAX_HEADER_BYTES)} cap")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelFileError(str(index), f"unreadable index: {exc.__class__.__name__}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(str(index), "index needs a weight_map of tensor name -> shard file")
    shards = []
    for name in sorted(set(weight_map.values())):
        shard = (index.parent / name).resolve()
        if index.parent.resolve() not in shard.parents:
            raise ModelFileError(str(index), f"shard {name!r} is outside the model directory")
        if not shard.is_file():
            raise ModelFileError(str(index), f"shard {name!r} is missing")
        shards.append(shard)
    return shards


def _combine(parts: list[ModelSize]) -> ModelSize:
    dtypes: dict[str, int] = {}
    for part in parts:
        for dtype, count in part.dtypes.items():
            dtypes[dtype] = dtypes.get(dtype, 0) + count
    return ModelSize(
        sum(p.params for p in parts), sum(p.bytes for p in parts), dtypes, tuple(f for p in parts for f in p.files)
    )
