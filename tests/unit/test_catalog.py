"""Catalog loading: the default, operator overrides, and errors that name file, line, class and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensora.config.catalog import default_catalog, load_catalog
from tensora.errors import CatalogError
from tensora.placement.catalog import Kind


def test_default_catalog_has_the_named_classes() -> None:
    cat = default_catalog()
    for name in ("l40s-48gb", "a100-80gb", "h100-80gb", "h200-141gb", "apple-metal-16gb", "cpu-16c-64g",
                 "cpu-32c-128g", "cpu-1c-4g", "cpu-2c-8g", "cpu-4c-16g"):
        assert name in cat
    assert cat["l40s-48gb"].kind is Kind.GPU and cat["l40s-48gb"].gpu_model == "L40S"
    assert cat["cpu-16c-64g"].kind is Kind.CPU and cat["cpu-16c-64g"].memory == 64 * 2**30
    assert [c.cpu for c in cat.cpu_classes] == sorted(c.cpu for c in cat.cpu_classes)


def test_operator_file_overrides_and_adds(tmp_path: Path) -> None:
    f = tmp_path / "catalog.yaml"
    f.write_text("classes:\n  - {name: cpu-1c-4g, kind: cpu, cpu: 1, memory: 6Gi}\n"
                 "  - {name: b200-192gb, kind: gpu, gpu: {model: B200, count: 1, memory: 192Gi},"
                 " cpu: 16, memory: 256Gi}\n")
    cat = load_catalog(f)
    assert cat["cpu-1c-4g"].memory == 6 * 2**30 and "b200-192gb" in cat and "l40s-48gb" in cat


BAD = {
    "unknown field": ("classes:\n  - name: x1\n    kind: cpu\n    cpu: 1\n    memory: 1Gi\n    colour: red\n",
                      ":6: classes[0].colour: unknown field (class x1)"),
    "duplicate name": ("classes:\n  - {name: x1, kind: cpu, cpu: 1, memory: 1Gi}\n"
                       "  - {name: x1, kind: cpu, cpu: 2, memory: 2Gi}\n", ":3: classes[1].name: duplicate class name"),
    "bad size": ("classes:\n  - {name: x1, kind: cpu, cpu: 1, memory: lots}\n", "classes[0].memory"),
    "zero cpu": ("classes:\n  - {name: x1, kind: cpu, cpu: 0, memory: 1Gi}\n", "classes[0].cpu"),
    "gpu class without gpu": ("classes:\n  - {name: x1, kind: gpu, cpu: 1, memory: 1Gi}\n", "needs a gpu"),
    "not yaml": ("classes: [\n", "not valid YAML"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_catalogs_name_file_line_and_field(tmp_path: Path, case: tuple[str, str]) -> None:
    text, message = case
    f = tmp_path / "catalog.yaml"
    f.write_text(text)
    with pytest.raises(CatalogError) as exc:
        load_catalog(f)
    assert str(f) in str(exc.value) and message in str(exc.value)
