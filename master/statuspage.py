"""The master's live status page, served by its HTTP endpoint beside ``/metrics``: ``/`` (the
page, everything inline), ``/status.json`` (what it polls) and ``/preview.png``. What each holds,
who may read them, and why a look never holds up the data path (the master's lock is held only
to copy the status, the plan and the history): docs/monitoring.md, "The master's status page".
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from hio.master.core import Master
from hio.master.preview import KnowledgePreview, Preview
from hio.master.service import dead_letter_message
from hio.master.stats import SAMPLE_SECONDS
from hio.transport.http import METRICS_ROLES, Reply, Route, html_page, text

LATEST_DEAD_LETTERS = 10
LATEST_DECISIONS = 12
PAGE = Path(__file__).with_name("statuspage.html").read_text()
_INLINE = {tag: re.findall(rf"<{tag}>(.*?)</{tag}>", PAGE, re.S) for tag in ("script", "style")}


def _as_json(message: Message) -> dict[str, Any]:
    """A message as the ``--json`` of ``hio status`` and ``hio scale`` prints it."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


class StatusPage:
    """The page's routes over ``master``, and the preview fetcher they share (:meth:`close`)."""

    def __init__(self, master: Master) -> None:
        self.master = master
        self.preview = KnowledgePreview(master.config, master.config.repository_address)

    def routes(self) -> dict[str, Route]:
        return {
            "/": Route(self.page, METRICS_ROLES, login=True),
            "/status.json": Route(self.status_json, METRICS_ROLES),
            "/preview.png": Route(self.preview_png, METRICS_ROLES),
        }

    def close(self) -> None:
        self.preview.close()

    def page(self, _query: Mapping[str, list[str]]) -> Reply:
        return html_page(200, PAGE, scripts=tuple(_INLINE["script"]), styles=tuple(_INLINE["style"]))

    def status_json(self, _query: Mapping[str, list[str]]) -> Reply:
        return Reply(200, json.dumps(self.snapshot()).encode(), "application/json")

    def preview_png(self, _query: Mapping[str, list[str]]) -> Reply:
        png = self.preview.cached().png
        return (
            text(404, "no preview image fetched from the repository") if png is None else Reply(200, png, "image/png")
        )

    def snapshot(self) -> dict[str, Any]:
        """One look at the master, for /status.json (see the module's doc)."""
        master = self.master
        status = master.status()
        scaling = master.scaling() if master.scaler is not None else None
        samples = master.history_samples()
        dead = master.dead.list(LATEST_DEAD_LETTERS, latest=True)
        if scaling is not None:
            del scaling.decisions[:-LATEST_DECISIONS]
        return {
            "unix": time.time(),
            "status": _as_json(status),
            "scaling": _as_json(scaling) if scaling is not None else None,
            "history": {
                "sample_seconds": SAMPLE_SECONDS,
                "samples": [[s.unix, s.tuples_per_second, s.latency_seconds] for s in samples],  # [unix, /s, s]
            },
            "dead_letters": [_as_json(dead_letter_message(d)) for d in dead],
            "preview": _preview_json(self.preview.current(), self.preview.address),
        }


def _preview_json(preview: Preview, address: str) -> dict[str, Any]:
    shown = {name: value for name, value in dataclasses.asdict(preview).items() if name not in ("png", "digest")}
    return {"repository": address, **shown, "version": preview.version if preview.png is not None else ""}
