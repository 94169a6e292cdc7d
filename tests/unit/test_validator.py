"""The size validator on safetensors files these tests write, including sharded and hostile ones."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tensora.errors import ModelFileError
from tensora.models import isolated
from tensora.models.validator import MAX_HEADER_BYTES, check_cpu, read_context, read_model


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
    from tensora.models.validator import ModelSize
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


CONTEXTS = [  # (name, config.json bytes or None for no file, expected context)
    ("llama-style", json.dumps({"max_position_embeddings": 4096}).encode(), 4096),
    ("gpt2-style", json.dumps({"n_positions": 1024}).encode(), 1024),
    ("multimodal, under text_config", json.dumps({"text_config": {"max_position_embeddings": 32768}}).encode(), 32768),
    ("the first key that says it", json.dumps({"seq_length": 2048, "max_position_embeddings": 8192}).encode(), 8192),
    ("no config", None, None),
    ("says nothing", json.dumps({"hidden_size": 64}).encode(), None),
    ("a boolean", json.dumps({"max_position_embeddings": True}).encode(), None),
    ("negative", json.dumps({"max_position_embeddings": -1}).encode(), None),
    ("absurd", json.dumps({"max_position_embeddings": 10**12}).encode(), None),
    ("a string", json.dumps({"max_position_embeddings": "4096"}).encode(), None),
    ("not json", b"{max_position_embeddings: 4096", None),
    ("a list", b"[4096]", None),
]


@pytest.mark.parametrize(("config", "expected"), [(c, e) for _, c, e in CONTEXTS], ids=[n for n, *_ in CONTEXTS])
def test_the_context_length_is_what_config_json_says_or_unknown(tmp_path: Path, config: bytes | None,
                                                               expected: int | None) -> None:
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": np.zeros((2,), dtype=np.float16)}, str(model / "model.safetensors"))
    if config is not None:
        (model / "config.json").write_bytes(config)
    assert read_context(model) == expected
    assert read_context(model / "model.safetensors") == expected  # a single file: its neighbour's config


def test_a_config_json_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"max_position_embeddings": 4096}))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").symlink_to(secret)
    assert read_context(model) is None


# -- the bounded parse (tensora.models.isolated) -------------------------------------------

def _many_tensors(path: Path, n: int) -> Path:
    header = {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}
    return _raw(path, json.dumps(header).encode(), b"\0" * n)


def test_a_child_reads_what_the_thread_reads(tmp_path: Path) -> None:
    f = _many_tensors(tmp_path / "m.safetensors", 500)
    assert isolated.header_bytes(f, isolated.INLINE_HEADER_BYTES) == f.stat().st_size - 8 - 500
    assert isolated.read_model(f, inline_bytes=0) == read_model(f)


def test_a_header_past_the_childs_memory_is_refused_naming_the_budget(tmp_path: Path) -> None:
    f = _many_tensors(tmp_path / "m.safetensors", 200_000)  # ~13 MiB of JSON: some 200 MiB of objects
    with pytest.raises(ModelFileError, match=r"need more than 64Mi of memory|within 64Mi of memory") as e:
        isolated.read_model(f, inline_bytes=0, memory_bytes=64 << 20)
    assert e.value.path == str(f)


def test_a_child_past_its_time_is_killed_and_refused(tmp_path: Path) -> None:
    f = _many_tensors(tmp_path / "m.safetensors", 10)
    with pytest.raises(ModelFileError, match=r"took longer than 0\.001 s"):
        isolated.read_model(f, inline_bytes=0, timeout_s=0.001)  # a Python process takes longer just to start


def test_a_large_index_goes_to_the_child_and_a_huge_one_is_refused(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {f"t{i}": "x.safetensors" for i in range(2)},
                                 "pad": "x" * (MAX_HEADER_BYTES + 1)}))
    assert isolated.header_bytes(tmp_path, 1 << 20) > 1 << 20
    with pytest.raises(ModelFileError, match="index exceeds the 16Mi cap"):
        read_model(tmp_path)
