"""Freed memory goes back to the system: glibc's malloc told not to keep large freed blocks.

glibc serves a block of at least its mmap threshold (128 KiB at start) with a mapping of its own,
returned on free. But each time such a block is freed, glibc raises the threshold to that block's
size, up to 32 MiB: once the first large activation of a forward is freed, every later block
under 32 MiB comes from the heap, and a freed block in the middle of the heap stays in the process.
A long prompt makes such blocks by the thousand, of sizes that grow with the context (KV caches,
attention scores, activations of each piece), and the heap keeps the holes between them. On the
8B-class layout at 8k prompt tokens, ONNX Runtime's `speculate` peaked 0.56 GiB higher that way
(docs/speculation.md, "Long prompts").

`return_freed_memory` fixes the threshold (a fixed one is never raised) and trims the heap at the
same size, as the documented MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables would. The
cost is a page fault per page of each new large block, small beside the arithmetic that fills it.
Standard library only; on a C library other than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

THRESHOLD_BYTES = 128 << 10  # glibc's own starting threshold, held fixed


def return_freed_memory(threshold: int = THRESHOLD_BYTES) -> bool:
    """Blocks of `threshold` bytes or more are mapped and unmapped on their own; the heap is trimmed
    past `threshold` bytes free at its top. True when glibc took both settings."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or not glibc's
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))
