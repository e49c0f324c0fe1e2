"""Memory the process no longer needs goes back to the system: glibc's malloc told not to keep
large freed blocks, and the pages of tables read by rows unmapped after each lookup (below).

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
Standard library only; on a C library other than glibc (or a system without madvise) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

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


# ---- tables read by rows ---------------------------------------------------------------------
# An embedding lookup touches a few rows of a large table, but a page fault on a file mapping maps
# the pages around it too (the kernel's fault-around, 64 KiB): 16k prompt tokens drawn over a 128k
# vocabulary leave most of an 8B-class table (1 GiB in bf16) in the process's RSS for good. A table
# read through a read-only file mapping can give its pages back after each lookup: they stay in the
# page cache (the next lookup maps them again without reading the disk), and a read-only mapping
# holds no page of its own, so nothing can be lost.

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_PAGE = mmap.PAGESIZE


def file_mapping_at(address: int, nbytes: int) -> tuple[str, int, str] | None:
    """(file path, file offset of `address`, permissions) of the file mapping that holds all of
    [address, address + nbytes), from /proc/self/maps; None where no file mapping holds it."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/") or fields[5].endswith(" (deleted)"):
            continue
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if start <= address and address + nbytes <= end:
            return fields[5], int(fields[2], 16) + address - start, fields[1]
    return None


def release_read_only_pages(address: int, nbytes: int) -> bool:
    """Unmap the pages that lie wholly inside [address, address + nbytes), a range of a READ-ONLY
    file mapping (checked by the caller once, when it mapped the file; see above). True when the
    kernel took the advice."""
    first = -(-address // _PAGE) * _PAGE
    last = (address + nbytes) // _PAGE * _PAGE
    if last <= first:
        return False
    return _madvise(first, last - first, MADV_DONTNEED) == 0


def _madvise(address: int, length: int, advice: int) -> int:
    global _madvise_fn
    if _madvise_fn is None:
        try:
            fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
        except (OSError, AttributeError, TypeError):
            fn = False
        else:
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _madvise_fn = fn
    return _madvise_fn(address, length, advice) if _madvise_fn else -1


_madvise_fn = None
