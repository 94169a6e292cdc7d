"""The HTTP API reference, from the control API's OpenAPI document (the app's ``openapi()``, what ``/openapi.json``
serves): each operation by tag with its summary, parameters, request body and responses. The running server's
``/docs`` and ``/redoc`` show the same document with its schemas in full."""

from __future__ import annotations

from typing import Any, cast

from tensora.docsgen import markdown as md

METHODS = ("get", "put", "post", "patch", "delete", "head", "options")


def document() -> dict[str, Any]:
    """The control API's OpenAPI document. Its routes alone make it: the app is built around no services (none
    of its handlers runs here)."""
    from tensora.api.app import create_app
    from tensora.api.services import Services

    guard = create_app(cast(Services, None), run_controller=False)
    return cast(dict[str, Any], guard.fastapi.openapi())


def _schema(schema: dict[str, Any] | None) -> str:
    """A schema in a few words: its reference's name, its type (of items), or its alternatives."""
    if not schema:
        return ""
    if "$ref" in schema:
        return str(schema["$ref"]).rpartition("/")[2]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_schema(s) for s in schema[key])
    if schema.get("type") == "array":
        return f"array of {_schema(schema.get('items'))}"
    if "enum" in schema:
        return " | ".join(str(v) for v in schema["enum"])
    return str(schema.get("type", "any"))


def _operation(method: str, path: str, op: dict[str, Any]) -> str:
    out = [f"### {method.upper()} {path}\n", md.paragraphs(op.get("summary") or op.get("operationId", ""))]
    if op.get("description"):
        out.append(md.commonmark(op["description"]))
    params = op.get("parameters", [])
    if params:
        out.append(md.table(["Parameter", "In", "Required", "Type", "Description"], (
            [md.code(p["name"]), p["in"], "yes" if p.get("required") else "no", md.cell(_schema(p.get("schema"))),
             md.commonmark(p.get("description", ""), one_line=True)] for p in params)))
    body = op.get("requestBody")
    if body:
        kinds = [f"{md.code(mime)}: {md.cell(_schema(c.get('schema')))}" for mime, c in body.get("content", {}).items()]
        out.append(f"Request body{' (required)' if body.get('required') else ''}: {'; '.join(kinds)}\n")
    responses = op.get("responses", {})
    if responses:
        out.append(md.table(["Status", "Description", "Body"], (
            [code, md.commonmark(r.get("description", ""), one_line=True),
             md.cell("; ".join(_schema(c.get("schema")) for c in r.get("content", {}).values()))]
            for code, r in responses.items())))
    return "\n".join(out)


def render() -> str:
    doc = document()
    info = doc["info"]
    out = ["# HTTP API reference\n", md.HEADER,
           f"{md.text(info['title'])} {md.text(info['version'])} (OpenAPI {md.text(doc['openapi'])}). A running "
           "server serves this document at `/openapi.json`, and shows it with every schema at `/docs` (Swagger UI) "
           "and `/redoc`.\n", md.commonmark(info.get("description"))]
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                op = item[method]
                by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((method, path, op))
    out.append(md.table(["Method", "Path", "Summary"], (
        [method.upper(), md.code(path), md.cell(op.get("summary", ""))]
        for ops in by_tag.values() for method, path, op in ops)))
    for tag, ops in by_tag.items():
        out.append(f"## {md.text(tag)}\n")
        out += [_operation(method, path, op) for method, path, op in ops]
    return "\n".join(out)
