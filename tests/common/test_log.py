"""The roles' log handler: one line per record on the stderr of the moment."""

from __future__ import annotations

import io
import logging
import sys
import threading

import pytest

from hio.process.log import setup_logging


def test_log_lines_go_to_the_stderr_of_the_moment_even_after_the_first_one_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program that replaces sys.stderr (a test runner's capture, an embedding application)
    keeps the role's lines; a thread logging after the stream it started with was closed is not
    'I/O operation on closed file'."""
    root = logging.getLogger()
    kept = list(root.handlers), root.level
    first, second = io.StringIO(), io.StringIO()
    errors: list[str] = []
    monkeypatch.setattr(logging, "raiseExceptions", True)
    monkeypatch.setattr(sys, "stderr", first)
    try:
        setup_logging("warning")
        logging.getLogger("hio.test").warning("to the first", extra={"n": 1})
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        worker = threading.Thread(target=lambda: logging.getLogger("hio.test").warning("from a thread, later"))
        worker.start()
        worker.join(5)
        errors = [line for line in second.getvalue().splitlines() if "Logging error" in line]
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in kept[0]:
            root.addHandler(handler)
        root.setLevel(kept[1])
    assert errors == []
    [line] = second.getvalue().splitlines()
    assert line.endswith("warning hio.test: from a thread, later")
