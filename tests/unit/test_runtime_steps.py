"""What an install's progress lines read as in a waiting workload's reason (``runtimes.step``): pure."""

from __future__ import annotations

import pytest

from tensora.models import runtimes

CASES = {
    "the environment": ("creating the environment /data/runtimes/tensora-transformers/venv",
                        (1, "its Python environment")),
    "the packages asked for": ("installing torch==2.13.0 transformers[serving]>=5.20 (57 pinned packages)",
                               (2, "torch 2.13.0 transformers[serving]>=5.20")),
    "unpinned": ("installing mlx-lm", (2, "mlx-lm")),
    "a package pip collects": ("[3/57] torch==2.13.0", (2, "torch 2.13.0")),
    "a package, unpinned": ("[4] numpy", (2, "numpy")),
    "unpacking": ("unpacking 57 packages into the environment", (3, "unpacking 57 packages into the environment")),
}


@pytest.mark.parametrize(("line", "expected"), CASES.values(), ids=CASES.keys())
def test_an_install_line_is_a_step_of_three(line: str, expected: tuple[int, str]) -> None:
    assert runtimes.step(line) == expected
    assert 1 <= expected[0] <= runtimes.STEPS
