"""The layers hold: the import contracts of pyproject.toml ([tool.importlinter]) pass, a broken one is reported, and
the gateway and the SDK load no admission, catalog, store, SQLAlchemy or YAML (``tensora`` re-exports lazily).

Each check runs a fresh interpreter: what a module loads is only visible before anything else imported it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tensora

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("tensora.placement.admission", "tensora.placement.capacity", "tensora.placement.catalog", "tensora.store",
         "sqlalchemy", "yaml")


def loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("statement", [
    "import tensora",
    "import tensora.gateway.chain",
    "import tensora.gateway.proxy",
    "import tensora.sdk",
    "from tensora import Client",
])
def test_the_gateway_and_the_sdk_load_no_admission_store_or_yaml(statement: str) -> None:
    modules = loaded_by(statement)
    assert not {m for m in modules for heavy in HEAVY if m == heavy or m.startswith(heavy + ".")}


def test_the_pure_gateway_plan_loads_nothing_but_itself_and_its_table() -> None:
    assert {m for m in loaded_by("import tensora.gateway.chain") if m.split(".")[0] == "tensora"} == {
        "tensora", "tensora.native", "tensora.gateway", "tensora.gateway.chain", "tensora.gateway.routes",
        "tensora.gateway.routedoc"}  # tensora.native: the guard of the compiled modules, put first by `import tensora`


def test_a_reexported_name_loads_its_module_on_first_use() -> None:
    modules = loaded_by("import tensora\nassert tensora.decide.__module__ == 'tensora.placement.admission'")
    assert "tensora.placement.admission" in modules
    assert sorted(tensora.__all__) == sorted(tensora._MODULE_OF)  # every name listed resolves, and no other
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tensora.nope


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is in the test extras (pyproject.toml)"
    return subprocess.run([exe, "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold() -> None:
    out = lint_imports()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_broken_contract_is_reported(tmp_path: Path) -> None:
    """The linter reads this tree's import graph: a contract the code breaks (serve opens the store) fails."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_package = "tensora"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "serve without a store"\ntype = "forbidden"\nsource_modules = ["tensora.serve"]\n'
                      'forbidden_modules = ["tensora.store"]\n')
    out = lint_imports("--config", str(config))
    assert out.returncode == 1
    assert "tensora.serve is not allowed to import tensora.store" in out.stdout
