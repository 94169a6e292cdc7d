"""Property-based tests of the control API from its own OpenAPI document (schemathesis).

A live server (a whole stack from ``tests/support/stack.py``, on SQLite and on PostgreSQL) gets
generated requests, valid and invalid, for every operation in ``/openapi.json``, with
alice's key. Every schemathesis check runs but one: no 5xx, only documented status codes,
content types and headers, bodies that match their schemas, invalid requests rejected,
405s whose ``Allow`` is right. ``positive_data_acceptance`` is left out because the
document cannot say everything the server checks: cross-field rules of a create body
(``model_bytes`` is for endpoints only, a class must be in the catalog) and an
Idempotency-Key reused with another body are 422s for schema-valid requests, by design.

Examples are bounded and derandomized (the same cases each run); about 30 s per database.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.support.services import LiveServer, serving
from tests.support.stack import Stack, stack

EXAMPLES_PER_OPERATION = 30
# Operations that a schema-valid request with alice's key can pass with nothing created first:
# each must have been answered 2xx at least once, or the run exercised only error paths.
MUST_SUCCEED = {"GET /healthz", "GET /readyz", "GET /v1/catalog", "GET /v1/usage", "GET /v1/workloads",
                "GET /v1/keys", "POST /v1/keys"}


@dataclass
class Live:
    stack: Stack
    server: LiveServer
    statuses: dict[str, set[int]] = field(default_factory=dict)


@pytest.fixture
def live(db_url: str, tmp_path: Path) -> Iterator[Live]:
    st = stack(db_url, tmp_path)
    try:
        with serving(st.app) as server:
            live = Live(st, server)
            yield live
    finally:
        st.services.db.dispose()
    ok = {label for label, codes in live.statuses.items() if any(200 <= c < 300 for c in codes)}
    assert not MUST_SUCCEED - ok, f"never answered 2xx: {sorted(MUST_SUCCEED - ok)}; seen: {live.statuses}"


@pytest.fixture
def api_schema(live: Live) -> Any:
    return schemathesis.openapi.from_url(f"{live.server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_every_operation_conforms_and_never_errs(case: Any, live: Live) -> None:
    st = live.stack
    response = case.call_and_validate(base_url=live.server.url, headers=st.headers(st.alice),
                                      excluded_checks=[positive_data_acceptance])
    label = f"{case.operation.method.upper()} {case.operation.path}"
    live.statuses.setdefault(label, set()).add(response.status_code)
    # every request carries alice's valid key: a 401 would mean the header was lost or overridden
    assert response.status_code != 401, response.text
    assert response.status_code < 500, response.text
