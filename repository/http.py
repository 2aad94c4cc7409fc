"""The repository's pages for people, served by its HTTP endpoint
(:mod:`hio.transport.http`, beside ``/metrics`` and ``/healthz``): the preview and a summary.

    /                 HTML page (refreshes every 10 s): preview + summary
    /preview.png      the preview image (404 when none)
    /knowledge.json   knowledge as JSON; assignments only with ?assignments=1

Read-only. With tokens, a reader presents one of a role that may read the knowledge
(``GetKnowledge``'s in :data:`hio.repository.service.POLICY`).
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping

from google.protobuf import json_format

from hio.proto import features_pb2
from hio.repository.service import POLICY
from hio.repository.store import FeatureStore
from hio.transport.http import Reply, Route, html_page, text

REFRESH_SECONDS = 10
PAGE_ROLES = frozenset(POLICY["GetKnowledge"])
# The page's one inline style: its Content-Security-Policy allows exactly this text (html_page)
STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
    "th,td{text-align:left;padding:2px 12px 2px 0}img{max-width:100%}"
)


def pages(store: FeatureStore) -> dict[str, Route]:
    """The repository's pages, for :func:`hio.transport.http.serve_http`."""

    def index(_query: Mapping[str, list[str]]) -> Reply:
        return html_page(200, render_page(store), styles=(STYLE,))

    def preview(_query: Mapping[str, list[str]]) -> Reply:
        png = store.get_knowledge_and_preview()[1]
        return text(404, "no preview yet") if png is None else Reply(200, png, "image/png")

    def knowledge_json(query: Mapping[str, list[str]]) -> Reply:
        data = store.get_knowledge_and_preview()[0]
        if data is None:
            return text(404, "no knowledge yet")
        knowledge = features_pb2.Knowledge.FromString(data)  # validated when it was put, and at start
        if query.get("assignments", ["0"])[-1] not in ("1", "true", "yes"):
            knowledge.ClearField("assignments")
            for group in knowledge.groups:
                group.ClearField("assignments")
        body = json_format.MessageToJson(
            knowledge,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
            unquote_int64_if_possible=True,
        )
        return Reply(200, body.encode(), "application/json")

    return {
        "/": Route(index, PAGE_ROLES),
        "/preview.png": Route(preview, PAGE_ROLES),
        "/knowledge.json": Route(knowledge_json, PAGE_ROLES),
    }


def render_page(store: FeatureStore) -> str:
    knowledge, preview = store.get_knowledge_and_preview()  # one read: the two belong together
    parsed = features_pb2.Knowledge.FromString(knowledge or b"")
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
    image = '<img src="/preview.png" alt="knowledge preview">' if preview is not None else "<p>No preview yet.</p>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>HarmonicIO repository</title>
<style>{STYLE}</style></head>
<body><h1>HarmonicIO repository</h1>
{image}
<h2>Summary</h2><table>{table}</table>
{groups}
<h2>Clusters (main group)</h2><table><tr><th>cluster</th><th>tuples</th></tr>{clusters}</table>
<p><a href="/knowledge.json">knowledge.json</a></p>
</body></html>
"""


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix)) if unix else "-"
