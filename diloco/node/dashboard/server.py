"""The dashboard's HTTP server (standard library only): one page and its JSON endpoints.

    GET /                 the page (HTML, with the current state embedded as JSON)
    GET /dashboard.js     the page's script: renders the state, polls /api/state
    GET /dashboard.css
    GET /api/state        {"run", "peers", "loss", "rounds", "fragments", "totals"}
    GET /api/<part>       one of them, e.g. /api/peers

Everything comes from ``SwarmView``; the JSON fields are documented in
``docs/dashboard.md``. Peer-supplied strings reach the page only as JSON data and are put
into the DOM as text, never as markup; the Content-Security-Policy allows this origin's
script and style only.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from diloco.node.dashboard.view import SwarmView

logger = logging.getLogger(__name__)

STATIC = {
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
STATE_MARK = "<!--STATE-->"
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'"


class DashboardServer:
    """Serves ``view`` on ``host:port`` (``port`` 0 picks a free one) in a daemon thread.

    Raises:
        OSError: the port is taken or the address is not this machine's.
    """

    def __init__(self, view: SwarmView, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.host = host
        self.files = {name: _read(name) for name in ("page.html", "dashboard.js", "dashboard.css")}
        handler = partial(_Handler, view, self.files)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="diloco-dashboard-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.httpd.server_port}/"

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def embed_state(page: str, state: object) -> str:
    """``page`` with ``state`` as the JSON text of its data block. ``<``, ``>`` and ``&``
    are escaped so that no string in it can end the block (``</script>``)."""
    text = json.dumps(state, allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return page.replace(STATE_MARK, text, 1)


def _read(name: str) -> str:
    return resources.files("diloco.node.dashboard").joinpath(name).read_text("utf-8")


class _Handler(BaseHTTPRequestHandler):
    server_version = "diloco-dashboard"

    def __init__(self, view: SwarmView, files: dict[str, str], *args: Any) -> None:
        self.view, self.files = view, files
        super().__init__(*args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        now = time.time()
        if path in ("/", "/index.html"):
            page = embed_state(self.files["page.html"], self.view.state(now))
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", page)
        elif path in STATIC:
            name, content_type = STATIC[path]
            self._send(HTTPStatus.OK, content_type, self.files[name])
        elif path == "/api/state":
            self._json(self.view.state(now))
        elif path.startswith("/api/"):
            try:
                self._json(self.view.view(path[len("/api/") :], now))
            except KeyError:
                self._json({"error": f"no such endpoint: {path}"}, HTTPStatus.NOT_FOUND)
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", "not found\n")

    def _json(self, value: object, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, "application/json", json.dumps(value, allow_nan=False))

    def _send(self, status: HTTPStatus, content_type: str, body: str) -> None:
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)
