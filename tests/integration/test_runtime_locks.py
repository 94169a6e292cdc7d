"""Runtimes install pinned: every package of a runtime's environment comes from its lock (constraints file)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tensora.models import runtimes


def pins(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in runtimes.lock_file(name).read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line} is not an exact pin"
            out[req.name.lower().replace("_", "-")] = spec.version
    return out


@pytest.mark.parametrize("name", sorted(runtimes.REGISTRY))
def test_every_runtime_package_is_pinned_by_its_lock(name: str) -> None:
    locked = pins(name)
    for package in runtimes.REGISTRY[name].packages:
        req = Requirement(package)
        key = req.name.lower().replace("_", "-")
        assert key in locked, f"{name}: {req.name} is not in {runtimes.lock_file(name).name}"
        assert req.specifier.contains(locked[key], prereleases=True), f"{name}: lock {locked[key]} vs {package}"


@pytest.mark.parametrize("name", ["tensora-transformers", "tensora-vllm-cpu"])
def test_cpu_runtimes_pin_the_cpu_torch(name: str) -> None:
    assert pins(name)["torch"] == runtimes.TORCH.split("==")[1]


def test_the_installed_runtime_has_exactly_the_locked_versions() -> None:
    where = os.environ.get("TENSORA_RUNTIMES_DIR")
    if not where or not runtimes.installed(Path(where), "tensora-transformers"):
        pytest.skip("TENSORA_RUNTIMES_DIR is not set: ./scripts/test installs tensora-transformers there")
    root = Path(where)
    record = json.loads((runtimes.env_dir(root, "tensora-transformers") / "installed.json").read_text())
    assert record["constraints"] == "tensora-transformers.txt"
    python = runtimes.env_dir(root, "tensora-transformers") / "venv" / "bin" / "python"
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True, env=runtimes.clean_env(dict(os.environ)))
    have = {p["name"].lower().replace("_", "-"): p["version"].split("+")[0] for p in json.loads(listed.stdout)}
    for package, version in pins("tensora-transformers").items():
        if package in have:
            assert have[package] == version, f"{package}: installed {have[package]}, locked {version}"
    assert have["torch"] == "2.13.0" and have["transformers"] == pins("tensora-transformers")["transformers"]
