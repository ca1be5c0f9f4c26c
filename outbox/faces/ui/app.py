"""The dashboard's web app: its routes, each a thin handler over ``pages.py``, and the
templates that draw them (autoescaped, so a memory's text is always shown as text).

Reads run in Starlette's thread pool; the three actions (retry, discard, forget) are POST
forms carrying the form token, and run one at a time.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from outbox.core.errors import DatabaseLacksRecords, ValidationError
from outbox.faces.ui import pages
from outbox.faces.ui.access import CSRF_FIELD, Access, AccessMiddleware, see_other
from outbox.operations.catalog import NoSuchRecord

if TYPE_CHECKING:
    from outbox.api import Outbox


def _when(seconds: float | None) -> str:
    """A stored time (seconds since the epoch) as UTC to the second."""
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def templates() -> Jinja2Templates:
    env = Environment(
        loader=PackageLoader("outbox.faces.ui", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["age"] = pages.age_text
    env.filters["when"] = _when
    env.filters["short"] = lambda key: key[:12]
    env.globals["urlencode"] = urlencode
    return Jinja2Templates(env=env)


class Dashboard:
    """The handlers over one open outbox."""

    def __init__(self, ob: Outbox, access: Access) -> None:
        self.ob = ob
        self.access = access
        self.templates = templates()
        self._actions = threading.Lock()

    def render(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        shared = {
            "csrf": self.access.csrf,
            "csrf_field": CSRF_FIELD,
            "note": request.query_params.get("note"),  # what the last action did
        }
        return self.templates.TemplateResponse(request, name, {**shared, **context}, status)

    def error(self, request: Request, exc: Exception, status: int) -> Response:
        """An unknown or malformed key, or a bad search: one line on a page of its own."""
        return self.render(request, "error.html", {"page": "memories", "message": str(exc)}, status)

    async def lost(self, request: Request, exc: Exception) -> Response:
        """Any page while the database lacks records its log names: what to run, not an
        empty store."""
        return self.error(request, exc, 503)

    # -- pages ----------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        data = await run_in_threadpool(pages.overview, self.ob)
        return self.render(request, "overview.html", {"page": "overview", **data})

    async def memories(self, request: Request) -> Response:
        filters = pages.Filters.of(request.query_params)
        try:
            data = await run_in_threadpool(pages.memories, self.ob, filters)
        except ValidationError as exc:
            return self.error(request, exc, 400)
        return self.render(
            request, "memories.html", {"page": "memories", "filters": filters, **data}
        )

    async def memory(self, request: Request) -> Response:
        prefix = request.path_params["key"]
        try:
            shown = await run_in_threadpool(pages.memory, self.ob, prefix)
        except NoSuchRecord as exc:
            return self.error(request, exc, 404)
        except ValidationError as exc:
            return self.error(request, exc, 400)
        return self.render(request, "memory.html", {"page": "memories", "memory": shown})

    async def dead(self, request: Request) -> Response:
        sink = request.query_params.get("sink") or None
        data = await run_in_threadpool(pages.dead_letters, self.ob, sink)
        return self.render(request, "dead.html", {"page": "dead", **data})

    # -- actions (POST, form token) -------------------------------------------------------

    async def _form(self, request: Request) -> dict[str, str] | None:
        """The form's fields, or None when its form token is missing or wrong."""
        form = await request.form()
        fields = {name: value for name, value in form.items() if isinstance(value, str)}
        return fields if self.access.csrf_ok(fields.get(CSRF_FIELD)) else None

    async def forget(self, request: Request) -> Response:
        fields = await self._form(request)
        if fields is None:
            return _refused()
        prefix = request.path_params["key"]

        def run() -> str:
            with self._actions:
                return self.ob.forget(prefix).text

        try:
            note = await run_in_threadpool(run)
        except NoSuchRecord as exc:
            return self.error(request, exc, 404)
        except ValidationError as exc:
            return self.error(request, exc, 400)
        return _back(f"/memories/{prefix}", note)

    async def dead_action(self, request: Request) -> Response:
        fields = await self._form(request)
        if fields is None:
            return _refused()
        action = request.path_params["action"]
        if action not in ("retry", "discard"):
            return PlainTextResponse("outbox ui: no such action", status_code=404)
        retry = action == "retry"
        key, sink = fields.get("key") or None, fields.get("sink") or None
        if key is None and fields.get("all") != "1":
            return PlainTextResponse("outbox ui: name a dead letter, or all", status_code=400)

        def run() -> int:
            with self._actions:
                change = self.ob.dead.retry if retry else self.ob.dead.discard
                return change([key] if key else None, sink=sink)

        count = await run_in_threadpool(run)
        verb = "Retried" if retry else "Discarded"
        noun = "dead letter" if count == 1 else "dead letters"
        # "All of one sink" returns to that sink's list; one letter, to the whole list.
        back = "/dead" + (f"?{urlencode({'sink': sink})}" if sink and key is None else "")
        return _back(back, f"{verb} {count} {noun}")


def _refused() -> Response:
    return PlainTextResponse("outbox ui: the form token is missing or wrong", status_code=403)


def _back(path: str, note: str) -> Response:
    """After an action, back to a page that says what was done (POST, then GET)."""
    joiner = "&" if "?" in path else "?"
    return see_other(f"{path}{joiner}{urlencode({'note': note})}")


def build_app(ob: Outbox, access: Access) -> Starlette:
    """The app over ``ob``, every route behind ``access``."""
    board = Dashboard(ob, access)
    static = StaticFiles(packages=[("outbox.faces.ui", "static")])
    app = Starlette(
        routes=[
            Route("/", board.overview),
            Route("/memories", board.memories),
            Route("/memories/{key}", board.memory),
            Route("/memories/{key}/forget", board.forget, methods=["POST"]),
            Route("/dead", board.dead),
            Route("/dead/{action:str}", board.dead_action, methods=["POST"]),
            Mount("/static", app=static, name="static"),
        ],
        exception_handlers={DatabaseLacksRecords: board.lost},
    )
    app.add_middleware(AccessMiddleware, access=access)
    return app
