"""How a rank writes a piece into its shared slot: memcpy, or streaming stores, by timing both.

A slot's piece is written by one rank and read by the others, so when the writer
comes back to the same bytes two pieces later, its peers' caches still hold
them. How much that costs the writer moves with where the virtual machine's CPUs
sit on the host, which changes by itself every few seconds. On the 2-vCPU
development VM, a broadcast of 1 MiB at world 4 through the root's slot
(`python benchmarks/bench_slot_write.py`, every method in turn in the same run):

- most of the time the root's memcpy into the slot took 20-21 µs, and streaming
  (non-temporal) stores, which leave nothing in the writer's cache for the readers
  to find there, 25-28 µs: the broadcast took 1.15x as long streaming;
- for stretches of a few seconds at a time, the memcpy took 96-128 µs (every line
  it writes is held by a reader's cache elsewhere) while streaming stores still took
  25 µs: the broadcast took 200-240 µs by memcpy, 110-130 streaming.

Neither is right all the time, and nothing short of trying tells them apart, so
the writer times its copies (the copy alone: a few tens of nanoseconds of clock
reads against tens of microseconds) and uses whichever wrote a byte faster in its
last few tries, trying the other one every EXPLORE-th copy to notice a change.

Pieces under MIN_BYTES are copied by memcpy: their times are too short to tell
the two apart, and streaming them only pushes them out of the cache. Streaming
needs the optional copy helper (accord/copy_core.c, x86-64); without it, or with
ACCORD_COPY_HELPER=0, every piece is a memcpy.
"""
import os
import time

try:
    from ..copy_core import stream_copy
    from ..copy_core import STREAMING as _HELPER_STREAMS
except ImportError:         # not built here, or built before it said whether it streams
    stream_copy, _HELPER_STREAMS = None, 0

MIN_BYTES = 128 << 10       # smaller pieces are always memcpy'd
EXPLORE = 128               # every EXPLORE-th timed copy starts a run of the other method
RUN = 4                     # ... of this many copies
KEEP = 3                    # the latest times kept per method (the median decides)
FORCE = None                # "memcpy" or "stream": benchmarks and tests pin a method


def available():
    """Whether streaming stores can be chosen here: the helper is built, streams on
    this CPU, and is not turned off with ACCORD_COPY_HELPER=0."""
    return stream_copy is not None and bool(_HELPER_STREAMS) and \
        os.environ.get("ACCORD_COPY_HELPER", "1").strip() != "0"


class SlotCopier:
    """One writer's choice between memcpy and streaming stores (see the module's text).

    A time counts only where the two copies before it used the same method: a slot's
    bytes come round again every other piece, and what the last write through them
    left in the caches (streaming leaves nothing) changes the next one's cost, so
    the first memcpy after streaming is slower than memcpy in a row. The method not
    in use is therefore tried in runs of RUN copies, every EXPLORE-th copy (at first
    after two copies, to time both early).

    clock: seconds as a float (tests pass a fake one)."""

    __slots__ = ("streams", "_times", "_use", "_count", "_run", "_trying", "_last",
                 "_clock")

    def __init__(self, streams=None, clock=time.perf_counter):
        self.streams = available() if streams is None else streams
        self._times = {False: [], True: []}    # streaming? -> latest seconds per byte
        self._use = False                      # the method in use: memcpy at first
        self._count = 0                        # copies timed, exploring runs aside
        self._run = 0                          # copies left in an exploring run
        self._trying = False                   # the method that run uses
        self._last = (None, None)              # the methods of the two copies before
        self._clock = clock

    def copy(self, dst, src):
        """dst[:] = src, for a piece of a shared slot (dst: its memoryview; src: a
        bytes-like view of as many bytes)."""
        n = len(dst)
        force = FORCE
        if not self.streams or n < MIN_BYTES or force == "memcpy":
            dst[:] = src
            return
        if force == "stream":
            stream_copy(dst, src)
            return
        if self._run:
            self._run -= 1
            stream = self._trying
        else:
            self._count += 1
            if self._count % EXPLORE == 0 or self._count == 3 and not self._times[True]:
                self._trying = stream = not self._use
                self._run = RUN - 1
            else:
                stream = self._use
        t0 = self._clock()
        if stream:
            stream_copy(dst, src)
        else:
            dst[:] = src
        took = (self._clock() - t0) / n
        clean = self._last == (stream, stream)
        self._last = (self._last[1], stream)
        if clean:
            times = self._times[stream]
            times.append(took)
            if len(times) > KEEP:
                del times[0]
            if not self._run:
                self._use = self._faster()

    def _faster(self):
        """Whether streaming wrote a byte faster than memcpy in the latest tries (the
        median of each method's, so one copy interrupted by the scheduler decides
        nothing); the method in use while either has none."""
        mine, other = self._times[False], self._times[True]
        if not mine or not other:
            return self._use
        return sorted(other)[len(other) // 2] < sorted(mine)[len(mine) // 2]

    @property
    def streaming(self):
        """The method the next copy outside an exploring run uses (True: streaming)."""
        return self._use
