"""Whether the shared-memory ring's C helper (transport/ring_core.c) is used.

The helper writes and takes a one-piece collective message (and takes a small
tagged one) in one C call, with the same words, fences and wake-up checks as
shm.py's pure-Python code, so ranks with and without it interoperate. It is
built by `pip install` where a C compiler is found, and is optional:

- not built (no compiler, another platform): the pure path, silently;
- ACCORD_RING_HELPER=0: the pure path, on purpose (to compare the two, or to
  rule the helper out);
- otherwise: the helper.

The choice is made when a group's shared-memory links are set up.
"""
import os

try:
    from . import ring_core
except ImportError:          # not built here: the pure path serves
    ring_core = None


def built():
    """Whether the helper was compiled into this installation."""
    return ring_core is not None


def wanted():
    """Whether new shared-memory links use it: built, and not turned off."""
    return ring_core is not None and os.environ.get("ACCORD_RING_HELPER", "1").strip() != "0"


def streams():
    """Whether its put can write a payload with streaming stores (x86-64 builds)."""
    return ring_core is not None and bool(getattr(ring_core, "STREAMING", 0))


def ring_link(*args):
    """A ring_core.RingLink over the given arena addresses (see ring_core.c's RingLink)."""
    return ring_core.RingLink(*args)
