"""Process tuning every role applies at start: malloc thresholds and the garbage collector.

**Large buffers.**
glibc serves an allocation above its mmap threshold with a fresh ``mmap``
and unmaps it on free; it also hands a free heap top above its trim
threshold back to the kernel. A tuple of 1 MB is copied several times on
its way (gRPC message, protobuf field, joined payload), and with the default
thresholds every copy is a new mapping whose ~250 pages all fault on first
touch, which costs several times the copy itself. With the thresholds raised
the heap's pages are reused, already mapped. The cost: a process keeps up to
:data:`TRIM_THRESHOLD` of freed heap for reuse instead of returning it to the
kernel at once.

**Garbage collection.** Every tuple allocates short-lived containers (gRPC
events, protobuf wrappers, frames); with the default threshold of 700 the
cyclic collector runs hundreds of times a second, and each older-generation
pass walks every object the imported libraries made at start (grpc,
protobuf, numpy: ~10^5), so at high tuple rates the collector takes a
visible share of a core. :func:`tune_process` moves what exists after
start-up out of the collector's sight (``gc.freeze``) and raises the first
threshold, so collections are rarer and only look at new objects.

``hio <role>`` calls :func:`tune_process`, which applies both; a program
embedding the gateway library may call it itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

log = logging.getLogger("hio")

MMAP_THRESHOLD = 64 << 20  # allocations below this come from the heap and are reused after free
TRIM_THRESHOLD = 256 << 20  # free heap kept before giving memory back to the kernel
GC_THRESHOLDS = (20_000, 20, 20)  # young-generation allocations before a collection; then generation ratios
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


@functools.cache
def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where libc is not glibc.

    An explicit ``GLIBC_TUNABLES``/``MALLOC_*_`` setting of the
    operator still applies to child processes started without ``hio``.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not tuned:
        log.debug("mallopt refused the thresholds; large buffers stay mmap'd")
    return tuned


def tune_process() -> None:
    """Both tunings (every object alive now exempt from future collections, which become
    rarer); call once the role's modules are imported, before it serves."""
    tune_malloc()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
