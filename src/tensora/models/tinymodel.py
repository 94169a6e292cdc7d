"""``tensora dev tiny-model DIR``: a real Hugging Face causal LM, small enough for demos and tests.

A Llama (``LlamaForCausalLM``) with random weights, in safetensors, and a byte-level BPE
tokenizer trained here on a built-in text (the ``tokenizers`` package), with a chat template.
head_dim is 32 so vLLM's CPU backend accepts it. Nothing is downloaded: no hub is needed,
and none is reachable from where Tensora's tests run. Its answers are gibberish, by design.

Needs ``numpy``, ``safetensors`` and ``tokenizers`` (``pip install 'tensora[local]'``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tensora.errors import TensoraError

VOCAB = 1024
HIDDEN = 64
LAYERS = 2
HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 128
MAX_POSITIONS = 2048
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
Tensora is a free GPU cloud. People run notebooks, virtual machines and inference endpoints on
GPU classes. When GPUs sell out, a workload may fall back to another class or to the CPU, but only
if it asked to, and every response says what served it. A notebook placed on the CPU can restart on
the GPU when capacity frees. An endpoint moves back by itself: it starts a replica on the better
class, waits until it is ready, shifts traffic, and stops the fallback replica.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thank you.
What is the weather like? It is sunny and warm. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""


def _corpus(seed: int) -> list[str]:
    """The built-in text, and made-up words of common syllables, so that BPE finds ~1,000 merges."""
    import random

    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"] + ["th", "ng", "st", "er", "an", "in"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400)]
    return [_CORPUS] * 4 + lines


class TinyModelError(TensoraError):
    """The tiny model could not be written."""


def write_tiny_model(directory: Path | str, seed: int = 0) -> dict[str, Any]:
    """Write the model into ``directory`` (created; must be empty if it exists). Returns its config."""
    try:
        import numpy as np
        from safetensors.numpy import save_file
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    except ImportError as exc:
        raise TinyModelError(f"needs numpy, safetensors and tokenizers: pip install 'tensora[local]' ({exc})") from None
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TinyModelError(f"{out}: exists and is not an empty directory")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    # the tokenizer: byte-level BPE, trained on the text above (with every byte in the alphabet)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos, eos, pad = (tok.token_to_id(t) for t in SPECIAL[:3])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[
        ("<s>", bos)])
    tok.save(str(tmp / "tokenizer.json"))
    vocab = tok.get_vocab_size()

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "torch_dtype": "float32",
        "dtype": "float32", "initializer_range": 0.02, "use_cache": True,
    }
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": w(vocab, HIDDEN), "lm_head.weight": w(vocab, HIDDEN),
                               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
                                   "do_sample": False, "max_new_tokens": 32},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                  "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": MAX_POSITIONS,
                                  "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False},
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
    }
    for name, data in files.items():
        (tmp / name).write_text(json.dumps(data, indent=2) + "\n")
    (tmp / "README.md").write_text("A tiny random Llama written by `tensora dev tiny-model`: for demos and "
                                   "tests only; its answers are gibberish.\n")
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)  # all or nothing: a failed write leaves no half model behind
    return config
