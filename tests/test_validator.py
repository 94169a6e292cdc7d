"""The size validator on safetensors files these tests write, including sharded and hostile ones."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tensora.errors import ModelFileError
from tensora.validator import MAX_HEADER_BYTES, check_cpu, read_model


def test_single_file_counts_params_bytes_and_dtypes(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    save_file({"a": np.zeros((4, 8), np.float16), "b": np.zeros((10,), np.float32)}, str(f))
    size = read_model(f)
    assert (size.params, size.bytes) == (42, 4 * 8 * 2 + 40)
    assert dict(size.dtypes) == {"F16": 32, "F32": 10}


def test_sharded_directory_with_index(tmp_path: Path) -> None:
    save_file({"x": np.zeros((100,), np.float16)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"y": np.zeros((50, 2), np.float16)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    size = read_model(tmp_path)
    assert (size.params, size.bytes, len(size.files)) == (200, 400, 2)


def test_cpu_limit_in_params() -> None:
    from tensora.validator import ModelSize
    assert check_cpu(ModelSize(8_030_000_000, 16 * 2**30)).allowed
    verdict = check_cpu(ModelSize(70_000_000_000, 140 * 2**30))
    assert not verdict.allowed and "> the CPU limit of 8.5B" in verdict.reason


def _raw(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


HOSTILE = {
    "empty file": (b"", None, b"", "truncated"),
    "huge header length": (b"{}", MAX_HEADER_BYTES + 1, b"", "exceeds"),
    "header longer than file": (b"{}", 1000, b"", "truncated"),
    "not JSON": (b"\xff\xfe not json", None, b"", "not JSON"),
    "JSON but not an object": (b"[1,2]", None, b"", "not a JSON object"),
    "unknown dtype": (json.dumps({"t": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode(), None,
                      b"\0", "unknown dtype"),
    "offsets out of range": (json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(),
                             None, b"\0" * 4, "out of range"),
    "size does not match shape": (json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode(),
                                  None, b"\0" * 8, "expected 16"),
    "negative shape": (json.dumps({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}).encode(),
                       None, b"", "shape"),
    "overlapping tensors": (json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                        "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}).encode(),
                            None, b"\0" * 6, "overlap"),
}


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_headers_give_clear_errors(tmp_path: Path, case: tuple[bytes, int | None, bytes, str]) -> None:
    header, length, data, message = case
    path = tmp_path / "bad.safetensors"
    if header == b"" and length is None:
        path.write_bytes(b"abc")
    else:
        _raw(path, header, data, length)
    with pytest.raises(ModelFileError) as exc:
        read_model(path)
    assert message in str(exc.value) and "bad.safetensors" in str(exc.value)


def test_directory_without_models_and_index_escaping(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"no \.safetensors"):
        read_model(tmp_path)
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../etc/passwd"}}))
    with pytest.raises(ModelFileError, match="outside the model directory"):
        read_model(tmp_path)
