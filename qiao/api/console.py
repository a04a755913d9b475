"""The web console at `/ui`: plain HTML, CSS and ES modules from `qiao/api/console/`, no build.

`ConsoleShell` is pure ASGI and sits in front of the auth middleware: it answers `GET /ui`,
`/ui/` and `/ui/<file>` itself (and `/` with a redirect to `/ui` on the main listener) and hands
every other request on untouched. The shell carries no data (no model names, no figures, no
configuration), so anyone may load it, like a login page. Everything it shows it fetches from the
ordinary routes (`/v1/...`, `/metrics`, the management API), each call with
`Authorization: Bearer <key>`, which the console asks for when a route answers 401 and keeps in
the tab's sessionStorage. Auth on every data route stays exactly as it is; no cookie is ever
accepted, so no cross-site request can act with a stored credential.

Every console answer carries a Content-Security-Policy without 'unsafe-inline' or 'unsafe-eval'
(scripts, styles and fetches from this origin only; no framing, no forms, no plugins), nosniff
and no-referrer. The same console runs on the management listener (`listener="management"`),
where its models page loads, unloads and sets traffic with the management token; the page knows
which listener served it from `<body data-listener>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from qiao.api.middleware import ASGIApp, Receive, Scope, Send

CONSOLE_DIR = Path(__file__).with_name("console")
PREFIX = "/ui"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    # Small files: always revalidated, so an upgraded server never runs yesterday's script.
    (b"cache-control", b"no-cache"),
]

Listener = Literal["main", "management"]


def load_files(listener: Listener) -> dict[str, tuple[bytes, str]]:
    """The console's files: name -> (body, media type); index.html names its listener."""
    files = {}
    for path in sorted(CONSOLE_DIR.iterdir()):
        media_type = MEDIA_TYPES.get(path.suffix)
        if media_type is not None and path.is_file():
            files[path.name] = (path.read_bytes(), media_type)
    body, media_type = files["index.html"]
    files["index.html"] = (body.replace(b"{{listener}}", listener.encode()), media_type)
    return files


class ConsoleShell:
    """Serves the console's static files before auth (see the module docstring); `/` redirects
    to `/ui` when `redirect_root`."""

    def __init__(
        self, app: ASGIApp, listener: Listener = "main", redirect_root: bool = True
    ) -> None:
        self.app = app
        self.files = load_files(listener)
        self.redirect_root = redirect_root

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/" and self.redirect_root and scope["method"] in ("GET", "HEAD"):
            await self._answer(scope, send, 307, b"", extra=[(b"location", PREFIX.encode())])
        elif path in (PREFIX, PREFIX + "/"):
            await self._file(scope, send, "index.html")
        elif path.startswith(PREFIX + "/"):
            await self._file(scope, send, path[len(PREFIX) + 1 :])
        else:
            await self.app(scope, receive, send)

    async def _file(self, scope: Scope, send: Send, name: str) -> None:
        found = self.files.get(name)  # a fixed set of names: no path ever reaches the disk
        if scope["method"] not in ("GET", "HEAD"):
            await self._answer(
                scope, send, 405, b"method not allowed\n", extra=[(b"allow", b"GET")]
            )
        elif found is None:
            await self._answer(scope, send, 404, b"no such console file\n")
        else:
            await self._answer(scope, send, 200, found[0], found[1])

    @staticmethod
    async def _answer(
        scope: Scope,
        send: Send,
        status: int,
        body: bytes,
        media_type: str = "text/plain; charset=utf-8",
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        headers = [
            (b"content-type", media_type.encode()),
            (b"content-length", str(len(body)).encode()),
            *SECURITY_HEADERS,
            *(extra or []),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )
