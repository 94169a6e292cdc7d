"""What ``tensora chat`` says served an answer, from the gateway's headers (and the endpoint's
placement when the control API tells it): placed on a fallback class is not failed over."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tensora.cli.chat import Answered, Attempt, Placement, Verdict, explain, parse_attempts, read_headers

ON_CPU = Placement("l40s-48gb", {"rp_c": "cpu-2c-8g"})
ON_A100 = Placement("l40s-48gb", {"rp_a": "a100-80gb"})
ON_L40S = Placement("l40s-48gb", {"rp_g": "l40s-48gb", "rp_c": "cpu-2c-8g"})


def answered(served_by: str | None, attempts: str, *, fallback: bool | None = None, region: str = "local",
             model: str = "chat") -> Answered:
    return Answered(served_by, fallback, region, model, parse_attempts(attempts))


@dataclass
class Case:
    answer: Answered
    want: Verdict
    text: str
    placement: Placement | None = None


CASES = {
    "own replica, first time, on its class": Case(
        answered("replica", "chat/rp_g:ok"), Verdict.OWN, "served by the endpoint's own replica rp_g on l40s-48gb",
        ON_L40S),
    "own replica, first time, placement not known": Case(
        answered("replica", "chat/rp_g:ok"), Verdict.OWN, "served by the endpoint's own replica rp_g"),
    "placed on CPU, its own replica answered first time: not a failover": Case(
        answered("cpu", "chat/rp_c:ok", fallback=True), Verdict.PLACED_FALLBACK,
        "served by the endpoint's own replica rp_c (placed on cpu-2c-8g, a CPU fallback: no l40s-48gb was free)",
        ON_CPU),
    "placed on CPU, placement not known: the headers say it is a CPU replica": Case(
        answered("cpu", "chat/rp_c:ok", fallback=True), Verdict.PLACED_FALLBACK,
        "served by the endpoint's own replica rp_c (placed on a CPU class, a CPU fallback: no GPU of its class "
        "was free)"),
    "placed on another GPU class: the headers cannot tell, the placement can": Case(
        answered("replica", "chat/rp_a:ok"), Verdict.PLACED_FALLBACK,
        "served by the endpoint's own replica rp_a (placed on a100-80gb, a class fallback: no l40s-48gb was free)",
        ON_A100),
    "a replica the placement does not list yet: the headers speak": Case(
        answered("replica", "chat/rp_new:ok"), Verdict.OWN, "served by the endpoint's own replica rp_new", ON_CPU),
    "its GPU replica failed, its CPU replica answered": Case(
        answered("cpu", "chat/rp_g:connect_refused,chat/rp_c:ok", fallback=True), Verdict.FAILOVER,
        "another backend answered: the endpoint's own replica rp_c (placed on cpu-2c-8g, a CPU fallback: no "
        "l40s-48gb was free), after chat/rp_g failed (connection refused)", ON_L40S),
    "another replica of its own after one failed: a failover, no fallback": Case(
        answered("replica", "chat/rp_1:http_503,chat/rp_2:ok", fallback=False), Verdict.FAILOVER,
        "another backend answered: the endpoint's own replica rp_2, after chat/rp_1 failed (HTTP 503)"),
    "its only replica failed, then answered when tried again: named once, not a failover": Case(
        answered("replica", "chat/rp_g:http_503,chat/rp_g:ok", fallback=False), Verdict.RETRIED,
        "served by the endpoint's own replica rp_g on l40s-48gb when tried again, after it failed (HTTP 503)",
        ON_L40S),
    "a replica tried twice, then another: the first named once": Case(
        answered("cpu", "chat/rp_g:http_502,chat/rp_g:reset,chat/rp_c:ok", fallback=True), Verdict.FAILOVER,
        "another backend answered: the endpoint's own replica rp_c (placed on a CPU class, a CPU fallback: no GPU "
        "of its class was free), after chat/rp_g failed (HTTP 502, then connection reset)"),
    "a replica failing the same way twice, then another: named once, twice": Case(
        answered("cpu", "chat/rp_g:http_500,chat/rp_g:http_500,chat/rp_c:ok", fallback=True), Verdict.FAILOVER,
        "another backend answered: the endpoint's own replica rp_c (placed on a CPU class, a CPU fallback: no GPU "
        "of its class was free), after chat/rp_g failed twice (HTTP 500)"),
    "the serverless pool after a timeout and a skipped replica": Case(
        answered("serverless", "chat/rp_1:timeout,chat/rp_2:breaker_open,llama-8b/rp_s:ok", fallback=True,
                 model="llama-8b"), Verdict.FAILOVER,
        "another backend answered: the serverless pool's model llama-8b (replica rp_s), after chat/rp_1 failed "
        "(no first token in time), chat/rp_2 was skipped (its circuit breaker is open)"),
    "a fallback model, nothing of its own to try": Case(
        answered("fallback-model", "small/rp_f:ok", fallback=True, model="small"), Verdict.OTHER,
        "another backend answered: the fallback model small (replica rp_f); none of the endpoint's own replicas "
        "was ready to try"),
    "another region after its own replica failed": Case(
        answered("replica", "chat/rp_1:reset,peer:us-east:ok", fallback=True, region="us-east"), Verdict.FAILOVER,
        "another backend answered: region us-east's gateway (its replica answered there), after chat/rp_1 failed "
        "(connection reset)", ON_L40S),
    "no attempts header": Case(
        answered("replica", ""), Verdict.UNKNOWN, "the gateway did not say which backend answered"),
    "the last attempt is not ok": Case(
        answered("replica", "chat/rp_1:http_400"), Verdict.UNKNOWN, "the gateway did not say which backend answered"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_explain(case: Case) -> None:
    got = explain(case.answer, case.placement)
    assert (got.verdict, got.text) == (case.want, case.text)


ATTEMPTS = {
    "one": ("chat/rp_1:ok", [Attempt("chat/rp_1", "ok")]),
    "several, spaces tolerated": ("chat/rp_1:reset, chat/rp_2:ok", [Attempt("chat/rp_1", "reset"),
                                                                    Attempt("chat/rp_2", "ok")]),
    "a peer: the outcome follows the last colon": ("peer:us-east:ok", [Attempt("peer:us-east", "ok")]),
    "empty": ("", []),
    "garbage items are left out": ("nonsense,:ok,chat/rp_1:,chat/rp_2:ok", [Attempt("chat/rp_2", "ok")]),
}


@pytest.mark.parametrize(("value", "want"), ATTEMPTS.values(), ids=ATTEMPTS.keys())
def test_parse_attempts(value: str, want: list[Attempt]) -> None:
    assert list(parse_attempts(value)) == want


def test_read_headers() -> None:
    got = read_headers({"x-tensora-served-by": "cpu", "x-tensora-fallback": "true", "x-tensora-region": "local",
                        "x-tensora-attempts": "chat/rp_c:ok"}, "chat")
    assert got == Answered("cpu", True, "local", "chat", (Attempt("chat/rp_c", "ok"),))
    assert read_headers({}, None) == Answered(None, None, None, None, ())
