"""Keeps glibc's allocator from returning training activations to the kernel after every step.

With glibc's defaults, blocks of a few MiB (a CNN's activations) are served by ``mmap`` and
unmapped on free, so every training step page-faults them in again, and each thread gets its own
arena. On 2 CPU cores that cost 15-40 % of a step (measured in ``bench/pipeline.py``; see
docs/pipeline.md). ``mallopt`` changes the same knobs as the ``MALLOC_*`` environment variables,
but at run time, so ``echopipe train`` needs no wrapper script. It is a no-op on other C
libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

KEEP_FREED_BELOW_BYTES = 1 << 30
MMAP_ABOVE_BYTES = 32 << 20


def tune_host_allocator(single_arena: bool = True) -> bool:
    """Keep freed memory for reuse (and, with ``single_arena``, use one arena); returns False
    where glibc is absent.

    One arena suits CPU training, where the stage threads hand activations to each other; on a
    GPU host the activations live on the device and DALI's many host threads keep their arenas.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; all three must take effect for the tuning to mean anything.
    settings = [(_M_MMAP_THRESHOLD, MMAP_ABOVE_BYTES), (_M_TRIM_THRESHOLD, KEEP_FREED_BELOW_BYTES)]
    if single_arena:
        settings.insert(0, (_M_ARENA_MAX, 1))
    return all(mallopt(param, value) == 1 for param, value in settings)
