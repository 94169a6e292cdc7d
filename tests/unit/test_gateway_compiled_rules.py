"""The gateway's request path stays safe to compile with mypyc: no ``await`` inside an ``except`` or ``finally``.

In a coroutine compiled by mypyc, the end of a ``finally`` block, and code after an ``await`` inside an ``except``
handler, can re-raise whatever exception the thread holds; after an ``await`` that may be another request's
(mypyc issues #1114, #1177 are relatives). So the compiled modules catch into a variable, leave the block, and
await after it. This test reads the sources (it needs no build) and names each site that breaks the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tensora import native

GATEWAY = Path(__file__).resolve().parents[2] / "src" / "tensora" / "gateway"

COMPILED = tuple(m.rsplit(".", 1)[1] for m in native.GROUPS[native.GATEWAY])
"""The gateway modules compiled together (``tensora.native``)."""

def _suspensions(body: list[ast.stmt]) -> list[ast.Await | ast.AsyncWith | ast.AsyncFor]:
    """Awaits (and async with/for) in a block, not counting those in functions or lambdas defined there:
    those run later, outside the handler."""
    found: list[ast.Await | ast.AsyncWith | ast.AsyncFor] = []
    pending: list[ast.AST] = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Await | ast.AsyncWith | ast.AsyncFor):
            found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return found


def hazards(source: str, name: str) -> list[str]:
    """``name:line`` of each await lexically inside an ``except`` handler or ``finally`` body."""
    sites: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try | ast.TryStar):
            blocks = [handler.body for handler in node.handlers] + [node.finalbody]
            for block in blocks:
                sites.extend(f"{name}:{s.lineno}" for s in _suspensions(block))
    return sorted(set(sites), key=lambda site: int(site.split(":")[1]))


def foreign_async_with(source: str, name: str) -> list[str]:
    """``name:line`` of each ``async with`` on anything but ``asyncio.timeout(...)``. Compiled, an ``async with`` is
    itself a handler that awaits ``__aexit__`` and then re-raises what the thread holds: safe only where
    ``__aexit__`` never suspends, as ``asyncio.timeout``'s does not."""
    return [f"{name}:{node.lineno}" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.AsyncWith)
            and any(_opened(item) != "asyncio.timeout" for item in node.items)]


def _opened(item: ast.withitem) -> str:
    """What an ``async with`` item opens: the function called, or the object itself."""
    expr = item.context_expr
    return ast.unparse(expr.func if isinstance(expr, ast.Call) else expr)


@pytest.mark.parametrize("module", COMPILED)
def test_no_await_inside_except_or_finally(module: str) -> None:
    path = GATEWAY / f"{module}.py"
    assert hazards(path.read_text(), path.name) == []


@pytest.mark.parametrize("module", COMPILED)
def test_async_with_only_on_timeouts(module: str) -> None:
    path = GATEWAY / f"{module}.py"
    assert foreign_async_with(path.read_text(), path.name) == []


def _in_coroutine(code: str) -> str:
    """``code`` as the body of ``async def m()``: its line n is line n + 1."""
    return "async def m():\n" + "".join(f"    {line}\n" for line in code.splitlines())


CASES = {
    "await in except": ("try:\n    pass\nexcept E:\n    await f()\n", ["m.py:5"]),
    "await in finally": ("try:\n    pass\nfinally:\n    await f()\n", ["m.py:5"]),
    "async with in finally": ("try:\n    pass\nfinally:\n    async with x:\n        pass\n", ["m.py:5"]),
    "async for in except": ("try:\n    pass\nexcept E:\n    async for a in b:\n        pass\n", ["m.py:5"]),
    "nested in if": ("try:\n    pass\nexcept E:\n    if c:\n        x = await f()\n", ["m.py:6"]),
    "await after the block": ("try:\n    pass\nexcept E as e:\n    err = e\nawait f()\n", []),
    "await in try body": ("try:\n    await f()\nexcept E:\n    pass\n", []),
    "await in else": ("try:\n    pass\nexcept E:\n    pass\nelse:\n    await f()\n", []),
    "function defined in handler": ("try:\n    pass\nexcept E:\n    async def g():\n        await f()\n", []),
}


@pytest.mark.parametrize(("code", "expected"), CASES.values(), ids=CASES.keys())
def test_checker_cases(code: str, expected: list[str]) -> None:
    assert hazards(_in_coroutine(code), "m.py") == expected


WITH_CASES = {
    "a timeout": ("async with asyncio.timeout(1.0):\n    await f()\n", []),
    "a lock": ("async with lock:\n    await f()\n", ["m.py:2"]),
    "a session call": ("async with client.session():\n    await f()\n", ["m.py:2"]),
    "a timeout and a lock": ("async with asyncio.timeout(1.0), lock:\n    await f()\n", ["m.py:2"]),
}


@pytest.mark.parametrize(("code", "expected"), WITH_CASES.values(), ids=WITH_CASES.keys())
def test_async_with_cases(code: str, expected: list[str]) -> None:
    assert foreign_async_with(_in_coroutine(code), "m.py") == expected
