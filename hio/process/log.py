"""Structured, quiet logging: ``key=value`` lines (or JSON) on stderr.

Call :func:`setup_logging` once per process. Pass fields with
``log.info("routed", extra={"tuple_id": 7, "channel": "w1/0"})``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

_STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

#: Between info and warning: the one line a role logs when it is ready (serving, registered).
#: Shown at the default level ("warning"), so a role that starts well says so once; hidden at "error".
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self._json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k not in _STD and not k.startswith("_")}
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        if self._json:
            doc = {
                "ts": ts,
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
                **fields,
            }
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            return json.dumps(doc, default=str)
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        line = f"{ts} {record.levelname.lower():7s} {record.name}: {record.getMessage()}{extra}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to ``sys.stderr`` as it is when a record is logged, not as it was when logging was
    set up: a program that replaces it (a test runner capturing output, an embedding
    application) keeps the role's lines, and one that closed the old stream gets no
    'I/O operation on closed file' from a thread still logging."""

    @property  # read where logging.StreamHandler reads its attribute
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:  # StreamHandler.__init__ sets it; the property decides
        pass


def setup_logging(level: str = "warning", as_json: bool = False) -> None:
    """Configure the root logger once: one handler on (the current) stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter(as_json))
    root.addHandler(handler)
    wanted = getattr(logging, level.upper(), logging.WARNING)
    root.setLevel(NOTICE if wanted == logging.WARNING else wanted)
    logging.getLogger("py4j").setLevel(logging.WARNING)
