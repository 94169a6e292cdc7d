"""Model files made by the tests: a valid safetensors file of a chosen size of header."""

from __future__ import annotations

import json
import struct


def safetensors(tensors: int, pad_to: int = 0) -> bytes:
    """A valid safetensors file of ``tensors`` one-byte U8 tensors, its header padded (metadata) to at least
    ``pad_to`` bytes."""
    header: dict[str, object] = {f"layer.{i}.weight": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
                                 for i in range(tensors)}
    raw = json.dumps(header).encode()
    if len(raw) < pad_to:
        header["__metadata__"] = {"pad": "x" * (pad_to - len(raw))}
        raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * tensors
