"""A small HTTP view of the repository for people: the preview and a summary.

Read-only, stdlib only, served from a daemon thread; loopback by default.

    /                 HTML page (refreshes every 10 s): preview + summary
    /preview.png      the preview image (404 when none)
    /knowledge.json   knowledge as JSON; assignments only with ?assignments=1
    /healthz          "ok"
"""

from __future__ import annotations

import html
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from google.protobuf import json_format

from hio.config import ConfigError
from hio.proto import features_pb2
from hio.repository.store import FeatureStore

log = logging.getLogger("hio.repository.http")

REFRESH_SECONDS = 10


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    store: FeatureStore


class PreviewHttpServer:
    """The HTTP view on its own thread. ``port`` is the bound port."""

    def __init__(self, store: FeatureStore, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        try:
            self._server = _Server((host.strip("[]") or "127.0.0.1", int(port)), _Handler)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"http_listen: cannot listen on {listen} ({exc})") from None
        self._server.store = store
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="repository-http", daemon=True
        )

    def start(self) -> PreviewHttpServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "hio-repository"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        routes = {
            "/": self._index,
            "/preview.png": self._preview,
            "/knowledge.json": self._knowledge_json,
            "/healthz": self._healthz,
        }
        route = routes.get(url.path)
        if route is None:
            self._send(404, "text/plain; charset=utf-8", f"not found: {url.path}\n".encode())
            return
        try:
            route(parse_qs(url.query))
        except Exception:  # a page must never take the thread down silently
            log.exception("http request failed", extra={"path": url.path})
            self._send(500, "text/plain; charset=utf-8", b"internal error; see the repository log\n")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _healthz(self, _query: dict[str, list[str]]) -> None:
        self._send(200, "text/plain; charset=utf-8", b"ok\n")

    def _preview(self, _query: dict[str, list[str]]) -> None:
        png = self.server.store.get_knowledge_and_preview()[1]
        if png is None:
            self._send(404, "text/plain; charset=utf-8", b"no preview yet\n")
            return
        self._send(200, "image/png", png)

    def _knowledge_json(self, query: dict[str, list[str]]) -> None:
        knowledge = _knowledge(self.server.store)
        if knowledge is None:
            self._send(404, "text/plain; charset=utf-8", b"no knowledge yet\n")
            return
        if query.get("assignments", ["0"])[-1] not in ("1", "true", "yes"):
            knowledge.ClearField("assignments")
            for group in knowledge.groups:
                group.ClearField("assignments")
        text = json_format.MessageToJson(
            knowledge,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
            unquote_int64_if_possible=True,
        )
        self._send(200, "application/json", text.encode())

    def _index(self, _query: dict[str, list[str]]) -> None:
        page = render_page(self.server.store)
        self._send(200, "text/html; charset=utf-8", page.encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("http " + format, *args)  # noqa: G003 - the stdlib's %-format and its args, kept lazy


def _knowledge(store: FeatureStore) -> features_pb2.Knowledge | None:
    data = store.get_knowledge_and_preview()[0]
    if data is None:
        return None
    knowledge = features_pb2.Knowledge()
    knowledge.ParseFromString(data)  # validated when it was put
    return knowledge


def render_page(store: FeatureStore) -> str:
    """The HTML summary page."""
    parsed = _knowledge(store) or features_pb2.Knowledge()
    knowledge, preview = store.get_knowledge_and_preview()
    rows = [("records stored", str(store.latest()))]
    if knowledge is None:
        rows.append(("knowledge", "none yet"))
    else:
        rows += [
            ("knowledge computed", _when(parsed.computed_unix)),
            ("tuples clustered", str(parsed.tuple_count)),
            ("up to offset", str(parsed.up_to_offset)),
            ("algorithm", parsed.algorithm or "-"),
            ("features", ", ".join(parsed.feature_names) or "-"),
        ]
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    clusters = "".join(f"<tr><td>{c.id}</td><td>{c.count}</td></tr>" for c in parsed.clusters)
    groups = "".join(
        f"<tr><td>{html.escape(g.image)}</td><td>{html.escape(', '.join(g.feature_names))}</td>"
        f"<td>{g.tuple_count}</td><td>{len(g.clusters)}</td></tr>"
        for g in parsed.groups
    )
    if groups:
        groups = (
            "<h2>Groups (image + feature set, each clustered on its own)</h2><table><tr><th>image</th>"
            f"<th>features</th><th>tuples</th><th>clusters</th></tr>{groups}</table>"
        )
    image = (
        '<img src="/preview.png" alt="knowledge preview" style="max-width:100%">'
        if preview is not None
        else "<p>No preview yet.</p>"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>HarmonicIO repository</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
th,td{{text-align:left;padding:2px 12px 2px 0}}</style></head>
<body><h1>HarmonicIO repository</h1>
{image}
<h2>Summary</h2><table>{table}</table>
{groups}
<h2>Clusters (main group)</h2><table><tr><th>cluster</th><th>tuples</th></tr>{clusters}</table>
<p><a href="/knowledge.json">knowledge.json</a></p>
</body></html>
"""


def _when(unix: float) -> str:
    if not unix:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))
