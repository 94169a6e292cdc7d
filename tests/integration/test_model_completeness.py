"""An endpoint's model, checked at create for what its model server will load, over real HTTP on SQLite and
PostgreSQL: where the driver runs model servers, a model without a tokenizer or a config.json, or a lone
safetensors file, is a 422 naming what is missing (not a replica that crash-loops); on the simulated fleet, which
needs only the model's size, a lone file is sized as before."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.support.api import Api, assert_error, created
from tests.support.api import api as api  # the fixture, imported under its name
from tests.support.models import safetensors

EP = {"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g"}
CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048}).encode()


@dataclass(frozen=True)
class Case:
    files: tuple[str, ...]  # under the model's name, besides its weights
    model: str = "tiny"  # what the create names
    missing: str | None = None  # in the 422's message; None: created


CASES = {
    "config, tokenizer.json and weights -> created": Case(("config.json", "tokenizer.json")),
    "tokenizer_config.json is a tokenizer too -> created": Case(("config.json", "tokenizer_config.json")),
    "no tokenizer -> 422 naming it": Case(("config.json",), missing="model 'tiny' has no tokenizer (tokenizer.json "
                                                                    "or tokenizer_config.json): the model server "
                                                                    "needs it"),
    "no config.json -> 422 naming it": Case(("tokenizer.json",), missing="model 'tiny' has no config.json"),
    "a lone safetensors file -> 422: a directory is needed": Case((), model="tiny/model.safetensors",
                                                                  missing="model 'tiny/model.safetensors' is a "
                                                                          "single file"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_model_server_gets_what_it_loads_or_the_create_names_what_is_missing(api: Api, case: Case) -> None:
    api.stack.services.runs_models = True  # a server whose driver runs model servers (local, Kubernetes)
    alice = api.as_(api.stack.alice)
    assert alice.put("/v1/files/tiny/model.safetensors", content=safetensors(4)).status_code == 201
    for name in case.files:
        body = CONFIG if name == "config.json" else b"{}"
        assert alice.put(f"/v1/files/tiny/{name}", content=body).status_code == 201
    r = alice.post("/v1/workloads", json={**EP, "model": case.model})
    if case.missing is None:
        assert r.status_code == 201, r.text
        return
    err = assert_error(r, 422, "model")
    assert case.missing in err["message"], err
    assert str(api.tmp) not in err["message"]
    assert alice.get("/v1/workloads").json()["data"] == []


def test_the_simulated_fleet_sizes_a_lone_file_as_before(api: Api) -> None:
    """``tensora plan`` and a simulated fleet start no model server: a safetensors file is all they need."""
    alice = api.as_(api.stack.alice)
    assert alice.put("/v1/files/tiny.safetensors", content=safetensors(4)).status_code == 201
    assert created(alice, **EP, model="tiny.safetensors")["model_params"] == 4
