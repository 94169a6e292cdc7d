"""The dashboard: web pages at ``/`` over the public control API.

Each page is an ``AsyncClient`` (the SDK) calling this same app's API routes in-process, as the signed-in
user: the dashboard can do nothing the API would not let that user's key do, and has no store access of
its own. Sign-in takes an API key once and keeps a session instead (``signin``, ``tensora.api.sessions``):
the browser holds a random session id in an http-only, Secure, SameSite=Strict ``__Host-`` cookie, never
the key, and the page's client hands the API the session's principal in the ASGI scope
(``tensora.api.principal``), which no HTTP request can write. Every POST carries a CSRF token (double
submit: a cookie and a form field, compared in constant time) and a foreign ``Origin`` is refused. Pages
render on the server, so reading works without JavaScript; ``live.js`` refreshes the live parts every two
seconds, shows the CPU warning as soon as a CPU class is chosen in the create form and makes its obvious checks
(``form_errors``, which the server makes again) before any request. An admin's pages name each row's owner and
link the operator page. Every response
carries the headers of ``headers`` (a Content-Security-Policy without inline script or style, among them).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from tensora.api.schemas import TokenUsageOut, UsageOut
from tensora.dashboard.charts import bars_svg, colors, duration, usage_svg
from tensora.dashboard.signin import (
    CSRF_COOKIE,
    SESSION_COOKIE,
    SignIn,
    client,
    cookie_name,
    forget,
    principal,
    sessions,
    set_cookie,
)
from tensora.names import NAME_PATTERN
from tensora.placement.fallback import CPU_WARNING
from tensora.placement.kinds import WorkloadKind
from tensora.sdk import APIError, AuthenticationError, Workload
from tensora.sdk.calls import Call
from tensora.sdk.client import DEFAULT_GATEWAY_URL
from tensora.units import format_memory, parse_duration

HERE = Path(__file__).parent
STATIC = HERE / "static"
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["duration"] = duration


def when(iso: str | None) -> str:
    """An API timestamp for people: 2027-01-15 08:10:00 UTC."""
    return f"{iso[:10]} {iso[11:19]} UTC" if iso and len(iso) >= 19 else (iso or "")


templates.env.filters["when"] = when
templates.env.filters["size"] = format_memory  # the one style of sizes: 512Mi (``units``)

FALLBACK_SLOTS = 3
router = APIRouter(include_in_schema=False)


class PageError(Exception):
    """An error page with the API's status and message (e.g. 404: no such workload)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def isolation_notice(isolation: str | None, reason: str | None) -> str | None:
    """What every page says where replicas run unsandboxed, as ``tensora node``, the start banner and
    ``GET /v1/catalog`` (``isolation``) do: ``none`` (the operator's choice) or ``admin-only`` (this host
    cannot sandbox). Nothing when sandboxed, or for a driver without this isolation (``None``)."""
    if isolation == "none":
        return ("Replicas on this server run without a sandbox (isolation: none): every owner's code runs as "
                "Tensora's user.")
    if isolation == "admin-only":
        why = f" ({reason})" if reason else ""
        return f"This host cannot sandbox replicas{why}: only the admin's workloads run here."
    return None


def _isolation_notice(request: Request) -> str | None:
    """The notice for this server: its isolation is settings of the app's services (no store read), told
    only to a signed-in user, as the API tells it only to a key (``GET /v1/catalog``)."""
    services = getattr(request.app.state, "services", None)
    if services is None or getattr(request.state, "principal", None) is None:
        return None
    return isolation_notice(services.isolation, services.isolation_reason)


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    csrf = cookie_name(request, CSRF_COOKIE)
    token = request.cookies.get(csrf) or secrets.token_urlsafe(32)
    principal = getattr(request.state, "principal", None)
    signed_in, admin = principal is not None, bool(principal is not None and principal.is_admin)
    response = templates.TemplateResponse(request, name, {"csrf": token, "signed_in": signed_in, "admin": admin,
                                                          "isolation_notice": _isolation_notice(request),
                                                          **context}, status_code=status)
    if request.cookies.get(csrf) != token:
        set_cookie(response, request, CSRF_COOKIE, token)
    return response


async def _form(request: Request) -> dict[str, str]:
    """The POSTed form, once its CSRF token and Origin check out (else a 403 page)."""
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise PermissionError("this form came from another site")
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    cookie, sent = request.cookies.get(cookie_name(request, CSRF_COOKIE), ""), form.get("csrf", "")
    if not cookie or not hmac.compare_digest(cookie.encode(), sent.encode()):
        raise PermissionError("the form's CSRF token is missing or stale: reload the page and try again")
    return form


def _see(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


def install(app: FastAPI) -> None:
    """Add the dashboard to the control API's FastAPI app."""
    from fastapi.staticfiles import StaticFiles

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(SignIn)
    @app.exception_handler(AuthenticationError)  # cannot happen in-process (no key is sent): as SignIn
    async def _sign_in(request: Request, _: Exception) -> Response:
        response = Response(status_code=401) if request.url.path.startswith("/ui/") else _see("/login")
        forget(response, request, SESSION_COOKIE)
        return response

    @app.exception_handler(PermissionError)
    async def _forbidden(request: Request, exc: PermissionError) -> Response:
        return render(request, "error.html", 403, message=str(exc))

    @app.exception_handler(PageError)
    async def _page_error(request: Request, exc: PageError) -> Response:
        return render(request, "error.html", exc.status, message=str(exc))


def _badges(w: Workload) -> list[tuple[str, str]]:
    labels = {"cpu_fallback": "CPU fallback", "class_fallback": "class fallback", "move_back": "moving back",
              "back_off": "crash loop"}
    return [(c.reason, labels.get(c.reason, c.reason)) for c in w.conditions]


templates.env.globals["badges"] = _badges


# -- sign in ----------------------------------------------------------------------------------

@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> HTMLResponse:
    return render(request, "login.html")


@router.post("/login")
async def login(request: Request) -> Response:
    """The one request that carries the key: it starts a session, and the key goes no further (no cookie,
    page, redirect or log holds it)."""
    form = await _form(request)
    book = sessions(request)
    session_id = await run_in_threadpool(book.start, form.get("key", ""))
    if session_id is None:
        return render(request, "login.html", 401, error="That key was refused: check it and try again.")
    if old := request.cookies.get(cookie_name(request, SESSION_COOKIE)):
        await run_in_threadpool(book.end, old)  # the browser's previous session, if any, ends here
    response = _see("/")
    set_cookie(response, request, SESSION_COOKIE, session_id)
    set_cookie(response, request, CSRF_COOKIE, secrets.token_urlsafe(32))  # a new token for the new session
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Sign out: the session ends in the store, so a copy of its cookie is worth nothing either."""
    await _form(request)
    if session_id := request.cookies.get(cookie_name(request, SESSION_COOKIE)):
        await run_in_threadpool(sessions(request).end, session_id)
    response = _see("/login")
    forget(response, request, SESSION_COOKIE)
    return response


# -- workloads --------------------------------------------------------------------------------

async def _workloads(request: Request) -> list[Workload]:
    async with client(request) as c:
        page = await c.list_workloads(limit=500)
    return sorted(page.data, key=lambda w: w.created_at)  # the API pages by id; people read by age


@router.get("/", response_class=HTMLResponse)
async def workloads_page(request: Request) -> HTMLResponse:
    return render(request, "workloads.html", workloads=await _workloads(request))


@router.get("/ui/rows", response_class=HTMLResponse)
async def workload_rows(request: Request) -> HTMLResponse:
    return render(request, "_rows.html", workloads=await _workloads(request))


async def _detail(request: Request, workload_id: str) -> dict[str, Any]:
    async with client(request) as c:
        try:
            w = await c.get_workload(workload_id)
            events = await c.workload_events(workload_id)
        except AuthenticationError:
            raise  # to the sign-in page
        except APIError as exc:
            raise PageError(exc.status or 502, exc.message) from None
    gateway = os.environ.get("TENSORA_GATEWAY_URL", DEFAULT_GATEWAY_URL).rstrip("/") + "/v1"
    return {"w": w, "events": list(reversed(events)), "gateway": gateway}


@router.get("/workloads/{workload_id}", response_class=HTMLResponse)
async def workload_page(request: Request, workload_id: str) -> HTMLResponse:
    return render(request, "workload.html", **await _detail(request, workload_id))


@router.get("/ui/workloads/{workload_id}", response_class=HTMLResponse)
async def workload_live(request: Request, workload_id: str) -> HTMLResponse:
    return render(request, "_detail.html", **await _detail(request, workload_id))


@router.post("/workloads/{workload_id}/{action}")
async def workload_action(request: Request, workload_id: str, action: str) -> Response:
    form = await _form(request)
    async with client(request) as c:
        try:
            if action == "restart":
                await c.restart_workload(workload_id, form.get("placement", "policy"))
            elif action == "stop":
                await c.stop_workload(workload_id)
            elif action == "delete":
                await c.delete_workload(workload_id)
                return _see("/")
            else:
                return Response(status_code=404)
        except AuthenticationError:
            raise  # to the sign-in page
        except APIError as exc:
            return render(request, "error.html", exc.status or 502, message=exc.message,
                          back=f"/workloads/{workload_id}")
    return _see(f"/workloads/{workload_id}")


# -- create -----------------------------------------------------------------------------------

async def _classes(request: Request) -> dict[str, Any]:
    """The create form's class lists: the catalog's classes and the region whose free counts they show."""
    async with client(request) as c:
        catalog = await c.catalog()
    return {"classes": list(catalog.data), "region": catalog.region}


NAME_RULE = "lowercase letters, digits and '-', 1-63 characters, starting and ending with a letter or digit"
NAME_ERROR = f"The name must be {NAME_RULE}."
MAX_FALLBACK_AFTER_S = 30 * 86400.0
AFTER_ERROR = "Fallback after must be a duration such as 90s, 10m or 1h30m, at most 30 days."
CHECKS = {"name_pattern": NAME_PATTERN, "name_error": NAME_ERROR, "after_max_s": int(MAX_FALLBACK_AFTER_S),
          "after_error": AFTER_ERROR}
"""The same checks for ``live.js``, which makes them as you submit (the page says so before any request)."""


def form_errors(form: dict[str, str]) -> dict[str, str]:
    """What the create form says of every field the API would refuse for an obvious reason, all at once and in
    words, by the API's own rules (the API answers one field at a time; the rest is its message)."""
    errors: dict[str, str] = {}
    if not re.fullmatch(NAME_PATTERN, form.get("name", "").strip()):
        errors["name"] = NAME_ERROR
    after = form.get("fallback_after", "").strip()
    try:
        ok = not after or parse_duration(after) <= MAX_FALLBACK_AFTER_S
    except ValueError:
        ok = False
    if not ok:
        errors["fallback_after"] = AFTER_ERROR
    return errors


CPU_REQUESTED = ("You asked for a CPU class ({cls}): serving a model is roughly 10-50x slower than on a GPU, and "
                 "notebooks and VMs get no GPU")
"""The create form's warning when the class asked for is a CPU one (``{cls}``: its name; ``live.js`` fills it)."""


def _field(api_field: str | None) -> str:
    if not api_field:
        return "_"
    name = api_field.split("[")[0].split(".")[0]
    return {"fallback_after_s": "fallback_after", "fallback_models": "fallback_model"}.get(name, name)


@router.get("/new", response_class=HTMLResponse)
async def new_page(request: Request, kind: str = WorkloadKind.NOTEBOOK) -> HTMLResponse:
    return _new(request, {"kind": kind}, {}, **await _classes(request))


def _new(request: Request, form: dict[str, str], errors: dict[str, str], status: int = 200,
         **classes: Any) -> HTMLResponse:
    return render(request, "new.html", status, form=form, errors=errors, slots=FALLBACK_SLOTS,
                  cpu_warning=CPU_WARNING, cpu_requested=CPU_REQUESTED, checks=CHECKS, **classes)


@router.post("/new")
async def create(request: Request) -> Response:
    form = await _form(request)
    if errors := form_errors(form):
        return _new(request, form, errors, 422, **await _classes(request))
    kind = form.get("kind", "")
    chain = [v for i in range(FALLBACK_SLOTS) if (v := form.get(f"fallback_{i}", "").strip())]
    more: dict[str, Any] = {}
    if kind == WorkloadKind.ENDPOINT:
        more["model"] = form.get("model", "").strip() or None
        if form.get("replicas", "").strip():
            more["replicas"] = form["replicas"].strip()
    if kind == WorkloadKind.VM and form.get("image", "").strip():
        more["image"] = form["image"].strip()
    after = form.get("fallback_after", "").strip() or None
    async with client(request) as c:
        try:
            w = await c.create_workload(kind, form.get("name", "").strip(), form.get("gpu_class", ""),
                                        fallback=chain, fallback_after=after, **more)
        except AuthenticationError:
            raise  # to the sign-in page
        except APIError as exc:
            return _new(request, form, {_field(exc.field): exc.message}, 422 if exc.status == 422 else
                        exc.status or 502, **await _classes(request))
    news = [text for text in w.warnings if text != w.warning]  # the CPU one showed in the form before submit
    if news:  # created; say what the form could not (a class this region has none of) before moving on
        return _new(request, {"kind": kind}, {}, 201, created=w, created_warnings=news, **await _classes(request))
    return _see(f"/workloads/{w.id}")


# -- capacity and usage -------------------------------------------------------------------------

@router.get("/capacity", response_class=HTMLResponse)
async def capacity_page(request: Request) -> HTMLResponse:
    async with client(request) as c:
        catalog = await c.catalog()
        usage: UsageOut | None
        tokens: TokenUsageOut | None
        try:
            usage = await c.usage(["placed_class", "day"])
            tokens = await c.token_usage()
        except APIError:  # a key without usage:read still sees capacity
            usage = tokens = None
    rows = [r.model_dump() for r in usage.data] if usage else []
    admin = (await principal(request)).is_admin  # an admin reads every owner's: whose each row is
    by_served: dict[tuple[str, str], dict[str, int]] = {}
    for t in tokens.data if tokens else []:
        s = by_served.setdefault((t.owner if admin else "", t.served_by),
                                 {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        s["requests"] += t.requests
        s["prompt_tokens"] += t.prompt_tokens
        s["completion_tokens"] += t.completion_tokens
    return render(request, "capacity.html", catalog=catalog, region=catalog.region, usage=usage, rows=rows,
                  chart=usage_svg(rows), colors=colors(sorted({str(r["placed_class"]) for r in rows})),
                  tokens=by_served)


# -- operator (admin keys) ----------------------------------------------------------------------

def _seconds(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v * 1000:.0f} ms" if v < 1 else duration(v)


templates.env.filters["seconds"] = _seconds


@router.get("/operator", response_class=HTMLResponse)
async def operator_page(request: Request) -> HTMLResponse:
    """What an operator watches, from ``GET /v1/operator`` (admin keys only: the API's 403 is the page's)."""
    async with client(request) as c:
        try:
            ops: dict[str, Any] = await c.run(Call("GET", "/v1/operator", dict))
        except AuthenticationError:
            raise  # to the sign-in page
        except APIError as exc:
            raise PageError(exc.status or 502, "The operator page is for admin keys." if exc.status == 403
                            else exc.message) from None
    return render(request, "operator.html", ops=ops,
                  fallbacks=bars_svg(ops["fallbacks"], "Fallback placements, requested -> placed class"),
                  failovers=bars_svg(ops["failovers"], "Gateway failovers by trigger"))
