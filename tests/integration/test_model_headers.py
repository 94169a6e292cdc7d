"""An owner's model headers over real HTTP, on SQLite and PostgreSQL: a header over the cap is a 422 naming
the cap and the owner's own name for the file (never a host path), and a large header is parsed outside the
API process, so the worker that serves everyone else never holds the parse (its GIL, its memory)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tensora.models import validator
from tests.support.api import Api, assert_error
from tests.support.api import api as api  # the fixture, imported under its name
from tests.support.models import safetensors

MiB = 2**20


EP = {"kind": "endpoint", "name": "ep", "gpu_class": "l40s-48gb"}


@pytest.fixture
def parsed_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The files whose header this process parsed (the API serves from a thread of this process)."""
    seen: list[str] = []
    real = validator._parse_header

    def spy(where: str, raw: bytes, data_size: int) -> validator.ModelSize:
        seen.append(where)
        return real(where, raw, data_size)

    monkeypatch.setattr(validator, "_parse_header", spy)
    yield seen


def test_a_header_over_the_cap_is_422_naming_the_cap_and_the_file(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    body = safetensors(10, pad_to=20 * MiB)
    assert alice.put("/v1/files/big/model.safetensors", content=body).status_code == 201
    err = assert_error(alice.post("/v1/workloads", json={**EP, "model": "big"}), 422, "model")
    assert err["message"] == f"big/model.safetensors: header length {len(body) - 8 - 10} exceeds the 16Mi " \
                             f"cap on safetensors headers"
    assert str(api.tmp) not in err["message"]
    assert alice.get("/v1/workloads").json()["data"] == []
    assert alice.get("/healthz").status_code == 200


def test_a_large_header_is_parsed_outside_the_api_process(api: Api, parsed_here: list[str]) -> None:
    alice = api.as_(api.stack.alice)
    assert alice.put("/v1/files/large.safetensors", content=safetensors(30_000)).status_code == 201  # ~2 MiB
    assert alice.put("/v1/files/small.safetensors", content=safetensors(3)).status_code == 201
    r = alice.post("/v1/workloads", json={**EP, "model": "large.safetensors"})
    assert r.status_code == 201, r.text
    assert (r.json()["model"], r.json()["model_params"]) == ("large.safetensors", 30_000)
    assert parsed_here == []  # a child process parsed it
    r = alice.post("/v1/workloads", json={**EP, "name": "ep2", "model": "small.safetensors"})
    assert r.status_code == 201 and r.json()["model_params"] == 3
    assert [p.rsplit("/", 1)[-1] for p in parsed_here] == ["small.safetensors"]  # a small one, in the thread
    assert alice.get("/healthz").status_code == 200
