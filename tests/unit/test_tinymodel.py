"""``tensora dev tiny-model``: a real HF-format Llama, written all or nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tensora.models.tinymodel import HEAD_DIM, TinyModelError, write_tiny_model
from tensora.models.validator import check_cpu, read_model


def test_the_tiny_model_is_a_llama_with_a_trained_tokenizer_and_a_chat_template(tmp_path: Path) -> None:
    d = tmp_path / "tiny"
    config = write_tiny_model(d)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == HEAD_DIM >= 32
    assert json.loads((d / "config.json").read_text()) == config
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert 900 <= tok.get_vocab_size() <= 1024 == config["vocab_size"]
    text = "Hello, world! Tensora falls back to the CPU."
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text  # byte-level: lossless
    tensors = load_file(str(d / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (
        config["num_attention_heads"] * HEAD_DIM, config["hidden_size"])
    size = read_model(d)  # the validator reads it from its header
    assert size.params == sum(t.size for t in tensors.values()) and check_cpu(size, 1_000_000_000).allowed
    template = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    assert "add_generation_prompt" in template and "<|assistant|>" in template


def test_the_same_seed_writes_the_same_model(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "a", seed=7)
    write_tiny_model(tmp_path / "b", seed=7)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_a_non_empty_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    d = tmp_path / "taken"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(TinyModelError, match="not an empty directory"):
        write_tiny_model(d)
    assert [p.name for p in d.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "taken.partial").exists()
