"""One name rule: a workload's name and region, a catalog class's name and the server's region and namespace accept
and refuse the same names (``tensora.names``); the controller's lease is ``controller/<region>``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tensora.config.catalog import load_catalog
from tensora.config.settings import ServeSettings
from tensora.control.spec import WorkloadSpec
from tensora.errors import CatalogError
from tensora.names import controller_lease

NAMES = {  # name -> a DNS label?
    "a": True, "web-1": True, "0abc": True, "a" * 63: True,
    "": False, "-a": False, "a-": False, "A": False, "a_b": False, "a.b": False, "a" * 64: False, "é": False,
}


def accepted_by(where: str, name: str, tmp_path_factory: pytest.TempPathFactory) -> bool:
    try:
        if where == "workload name":
            WorkloadSpec.model_validate({"kind": "notebook", "name": name, "gpu_class": "l40s-48gb"})
        elif where == "workload region":
            WorkloadSpec.model_validate({"kind": "notebook", "name": "n", "gpu_class": "l40s-48gb", "region": name})
        elif where == "catalog class":
            path = tmp_path_factory.mktemp("catalog") / "catalog.yaml"
            path.write_text(f"classes:\n  - {{name: '{name}', kind: cpu, cpu: 1, memory: 1Gi}}\n")
            load_catalog(path)
        else:
            ServeSettings.model_validate({where.removeprefix("server "): name})
    except (ValidationError, CatalogError):
        return False
    return True


@pytest.mark.parametrize("where", ["workload name", "workload region", "catalog class", "server region",
                                   "server namespace"])
@pytest.mark.parametrize("name", NAMES, ids=lambda n: repr(n) if len(n) < 10 else f"{len(n)} letters")
def test_every_name_follows_one_rule(where: str, name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    assert accepted_by(where, name, tmp_path_factory) is NAMES[name]


def test_the_controller_lease_is_named_by_its_region() -> None:
    assert controller_lease("eu-1") == "controller/eu-1"
