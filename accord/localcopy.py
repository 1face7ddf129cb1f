"""Copies inside one process: a collective's own block, from the caller's input to its output.

all_gather copies this rank's block into its place in the output, a scatter's or
gather's root its own block; everything else moves between processes. Where a
block is larger than the cache can keep, a plain memcpy reads every destination
line before it writes it, and streaming (non-temporal) stores do not: on the
development VM a cold 4-64 MiB copy took 0.64-0.73x memcpy's time that way.
glibc's memcpy streams too, but only above a threshold it derives from the cache
size the CPU reports, which a virtual machine may overstate (320 MiB of L3
reported against 32 MiB present there: memcpy never streamed).

copy_into(dst, src) streams through the optional C helper (accord/copy_core.c,
built by `pip install` where a C compiler is found) when both are C-contiguous
arrays of the same dtype and at least STREAM_MIN bytes; anything else, or
without the helper, or with ACCORD_COPY_HELPER=0, is numpy's copy. Below the
cache's size a block may still be in it, and streaming would push it out to
memory (hot 1-4 MiB copies took 1.75-1.85x memcpy's time): STREAM_MIN is half
the last-level cache the kernel reports (sysfs), at least 4 MiB, and 16 MiB
where that is unknown.
"""
import os

import numpy as np

try:
    from .copy_core import STREAMING, stream_copy, views_copy
except ImportError:          # not built here: numpy copies
    STREAMING, stream_copy, views_copy = 0, None, None

_DEFAULT_MIN = 16 << 20
_FLOOR_MIN = 4 << 20


def _cache_bytes(path="/sys/devices/system/cpu/cpu0/cache"):
    """The largest cache the kernel lists for cpu 0, in bytes (0: not known)."""
    best = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        try:
            with open(os.path.join(path, name, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def stream_min(cache_bytes):
    """The smallest copy that streams, for a last-level cache of cache_bytes (0: unknown)."""
    return max(_FLOOR_MIN, cache_bytes // 2) if cache_bytes else _DEFAULT_MIN


STREAM_MIN = stream_min(_cache_bytes())


def built():
    """Whether the helper was compiled into this installation."""
    return stream_copy is not None


def helper_on():
    """Whether the copy helper (accord/copy_core.c) is built and not turned off with
    ACCORD_COPY_HELPER=0: every user of it asks here (this module's large copies,
    byte_stream.py's range copies, the streaming stores of transport/shared_write.py)."""
    return stream_copy is not None and os.environ.get("ACCORD_COPY_HELPER", "1").strip() != "0"


_STREAMING = helper_on()      # large copies stream


def copy_into(dst, src):
    """np.copyto(dst, src, casting="no") for numpy arrays, with streaming stores for a
    large C-contiguous pair of one shape (see the module's docstring)."""
    if dst.dtype != src.dtype:
        np.copyto(dst, src, casting="no")       # raises, as the callers' copies did
    elif _STREAMING and dst.nbytes >= STREAM_MIN and dst.flags.c_contiguous and \
            src.flags.c_contiguous and dst.shape == src.shape:
        stream_copy(dst, src)
    else:
        # an item assignment: a quarter of np.copyto's cost, on the 8-byte calls' path
        dst[...] = src
