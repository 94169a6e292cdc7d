"""Who may create what (control.workloads.authorize_create): the rules the API's create handler applies before a
spec is checked, a named case each."""

from __future__ import annotations

from typing import Any

import pytest

from tensora.control.spec import parse_spec
from tensora.control.workloads import Caller, NotAllowed, authorize_create
from tensora.errors import SpecError

NB = {"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb"}
ALICE = Caller("alice", admin=False, region="local", isolation="sandbox")
ADMIN = Caller("admin", admin=True, region="local", isolation="sandbox")
ADMIN_ONLY = "admin-only"

ALLOWED: dict[str, tuple[dict[str, Any], Caller, str, str]] = {
    "own workload, region filled in": (NB, ALICE, "alice", "local"),
    "own name given as owner": ({**NB, "owner": "alice"}, ALICE, "alice", "local"),
    "this server's region given": ({**NB, "region": "local"}, ALICE, "alice", "local"),
    "admin for another owner": ({**NB, "owner": "bob"}, ADMIN, "bob", "local"),
    "admin's serverless endpoint": ({"kind": "endpoint", "name": "ep", "gpu_class": "l40s-48gb", "model": "m",
                                     "spec": {"serverless": True}}, ADMIN, "admin", "local"),
    "admin's own on an admin-only host": (NB, Caller("admin", True, "local", ADMIN_ONLY, "no runc"), "admin",
                                          "local"),
}

REFUSED: dict[str, tuple[dict[str, Any], Caller, type[Exception], str | None, str]] = {
    "another owner's, not admin": ({**NB, "owner": "bob"}, ALICE, NotAllowed, "owner", "only admin keys"),
    "another region": ({**NB, "region": "eu"}, ALICE, SpecError, "region", "serves region 'local'"),
    "serverless, not admin": ({"kind": "endpoint", "name": "ep", "gpu_class": "l40s-48gb", "model": "m",
                               "spec": {"serverless": True}}, ALICE, NotAllowed, "spec.serverless", "serverless"),
    "owner on an admin-only host": (NB, Caller("alice", False, "local", ADMIN_ONLY, "no runc"), NotAllowed, None,
                                    "cannot sandbox workloads (no runc)"),
    "admin for another owner on an admin-only host": ({**NB, "owner": "bob"},
                                                      Caller("admin", True, "local", ADMIN_ONLY, "no runc"),
                                                      NotAllowed, None, "runs the admin owner's only"),
}


@pytest.mark.parametrize("case", ALLOWED)
def test_allowed(case: str) -> None:
    body, caller, owner, region = ALLOWED[case]
    spec = parse_spec(body)
    got, who = authorize_create(spec, spec.model_fields_set, caller)
    assert (who, got.region) == (owner, region)


@pytest.mark.parametrize("case", REFUSED)
def test_refused(case: str) -> None:
    body, caller, error, field, words = REFUSED[case]
    spec = parse_spec(body)
    with pytest.raises(error) as exc:
        authorize_create(spec, spec.model_fields_set, caller)
    assert getattr(exc.value, "field", None) == field and words in str(exc.value)
