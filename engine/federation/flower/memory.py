"""Keep glibc's allocator from handing large buffers back to the kernel after every message.

A FedSM round moves ~100 MB of weights per site through every federation process (the
SuperLink, the coordinator's ServerApp, each SuperNode and site), as 5 MB object chunks,
protobuf messages and arrays of up to 38 MB (the packed selector). With glibc's defaults
every buffer above the mmap threshold (dynamic, at most 32 MB) is a fresh ``mmap``; freeing
it unmaps it, and the next message faults the pages in again, each one zeroed by the kernel.
Threads get arenas of their own whose heaps are unmapped as soon as they are empty. Profiles
of a loopback round showed that zeroing (``clear_page_erms``) at ~12% of all CPU time across
the processes. Here large blocks come from the heap too, all threads share one arena, freed
memory is kept instead of trimmed and the heap grows in large steps, so the allocator reuses
the same pages round after round (zeroing fell to ~4%).

The price is memory held: each process keeps its high-water mark of heap (a few hundred MB
for the coordinator with FedSM and three sites) instead of returning it between rounds, and
threads contend for one allocator lock (they hold the GIL most of the time anyway). That is
what a long-running federation process wants; it is applied only to the federation
processes (``fedsm server``, ``fedsm site`` and their Flower children), not to the desktop
app or ``fedsm simulate``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc <malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

#: Largest allocation served by mmap when mmap is allowed (it is not, see ``MMAP_MAX``).
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit (HEAP_MAX/2)
#: No allocation is served by its own mmap: the packed selector is above any threshold.
MMAP_MAX = 0
#: One arena for all threads (Flower's request threads otherwise get heaps unmapped when idle).
ARENA_MAX = 1
#: Free memory at the top of the heap is given back only above this much.
TRIM_THRESHOLD = 1024 * 1024 * 1024
#: Extra heap requested with every growth.
TOP_PAD = 64 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Tune glibc malloc for processes that move large messages repeatedly (see the module).

    Returns
    -------
    bool
        ``True`` when the settings were applied; ``False`` on a C library without
        ``mallopt`` (macOS, Windows, musl), where nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_MMAP_MAX, MMAP_MAX), (_M_ARENA_MAX, ARENA_MAX),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    if not applied:
        log.debug("mallopt refused a setting; the allocator keeps its defaults for it")
    return applied


#: Allocations between young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 10_000


def freeze_startup_objects() -> None:
    """Keep the objects that exist now out of every later garbage collection, and collect less often.

    Called once a Flower component has imported and built what it serves with (FastAPI
    application, protobuf descriptors, pydantic models: hundreds of thousands of objects
    that live as long as the process). Without it, each full collection walks all of them:
    the SuperLink spent ~1/8 of its CPU in the collector while serving weight chunks.
    Request handling makes many short-lived containers, so young collections are spaced
    wider too; reference counting still frees everything that is not in a cycle at once.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
