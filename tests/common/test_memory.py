"""Process tuning applied by every `hio <role>`: glibc malloc thresholds and the collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

from hio.process.memory import GC_THRESHOLDS
from hio.transport.frames import crc32


def test_tuning_takes_effect_in_a_fresh_process() -> None:
    code = (
        "import gc, json; from hio.process.memory import tune_process, tune_malloc; tune_process(); "
        "print(json.dumps([tune_malloc(), list(gc.get_threshold()), gc.get_freeze_count()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    malloc_tuned, thresholds, frozen = json.loads(out.stdout)
    assert malloc_tuned is True  # glibc: mallopt accepted both thresholds
    assert tuple(thresholds) == GC_THRESHOLDS
    assert frozen > 10_000  # the imported libraries' objects are out of the GC's way


def test_fast_crc32_is_zlibs_crc32() -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[100:], crc32(data[:100])) == zlib.crc32(data)
    assert crc32(b"") == 0
