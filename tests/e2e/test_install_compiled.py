"""Set-up command 1 as a new user runs it compiles both hot paths: a fresh clone of this repository at HEAD,
installed into a fresh venv with ``pip install -e '.[local]'`` (pip's isolated build, nothing installed before),
runs both groups of ``tensora.native`` compiled.

The build's type check once saw the packages of the environment it installed into: a venv holding the test lock
compiled, a fresh one refused both groups and installed pure Python, said only under ``pip -v``. This test is the
fresh venv. It downloads the dependencies of ``local`` from the package index (or pip's configured mirrors).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from tensora import native

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(native.no_compiler() is not None, reason=f"cannot compile here: {native.no_compiler()}"),
    pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                       reason="needs git and this repository's history to clone HEAD"),
]

PROBE = """
import json, tensora.native as n
print(json.dumps({g: {"why_pure": n.why_pure(g), "file": __import__(m[0], fromlist=["_"]).__file__}
                  for g, m in n.GROUPS.items()}))
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without what would make the install or the probe see another Tensora."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", native.PURE_ENV, "VIRTUAL_ENV", "PIP_NO_BUILD_ISOLATION")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_command_1_in_a_fresh_venv_runs_both_groups_compiled(tmp_path: Path) -> None:
    clone, env_dir = tmp_path / "tensora", tmp_path / "venv"
    subprocess.run(["git", "clone", "--quiet", "--no-local", str(REPO), str(clone)], check=True, timeout=120)
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = _clean_env()

    install = subprocess.run([python, "-m", "pip", "install", "-v", "-e", ".[local]"], cwd=clone, env=env,
                             capture_output=True, text=True, timeout=840)
    said = [line for line in (install.stdout + install.stderr).splitlines() if "tensora build:" in line]
    assert install.returncode == 0, install.stderr[-4000:]

    probe = subprocess.run([python, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60, check=True)
    groups = json.loads(probe.stdout)
    assert set(groups) == set(native.GROUPS)
    for group, seen in groups.items():
        assert seen["why_pure"] is None, (group, seen["why_pure"], said)
        assert seen["file"].endswith(".so"), (group, seen["file"])
        assert Path(seen["file"]).is_relative_to(clone / "src"), seen["file"]  # the editable install's build
    record = json.loads((clone / "src" / "tensora" / native.MANIFEST).read_text())
    assert record["pure"] == {}
    assert set(record["sources"]) == {m for modules in native.GROUPS.values() for m in modules}
