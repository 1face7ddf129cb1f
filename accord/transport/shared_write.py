"""How a rank writes large messages into shared memory: memcpy, or streaming stores, timed.

Where a rank writes bytes that peers read (a piece of its shared slot, a message
in a ring), it comes back to the same bytes a piece or a message later, while
its peers' caches still hold them. How much that costs the writer moves with
where the virtual machine's CPUs sit on the host, which changes by itself every
few seconds: two processes and no accord, a 1 MiB memcpy into bytes the other
CPU had just read took 18-24 µs in some stretches and 98-127 µs in others,
streaming stores 24-25 µs in both (benchmarks/shared_write_floor.py). On the
2-vCPU development VM, a broadcast of 1 MiB at world 4 through the root's slot,
the three ways in turn in one run (`python benchmarks/bench_shared_write.py -n 4 --ops
broadcast --sizes 1M`; benchmarks/results/slot-write-epyc-21.md):

- most of the time the root's memcpy into the slot took 20-24 µs, and streaming
  (non-temporal) stores, which leave nothing in the writer's cache for the readers,
  25-31 µs: a broadcast took 81-98 µs by memcpy and 95-138 streaming;
- for seconds at a time the memcpy took 124-127 µs (every line it writes held by
  a reader's cache elsewhere) while streaming stores still took 25 µs: 216-229 µs
  a broadcast by memcpy, 102-107 streaming, 107-113 with the timed choice.

Over the run's 30 blocks of each the medians were 88.6 µs (memcpy), 115.4
(streaming) and 92.7 (timed); 20%, 7% and none of the blocks took over 1.5x the
best median.

Neither is right all the time, and nothing short of trying tells them apart, so
the writer times its copies (the copy alone: a few tens of nanoseconds of clock
reads against tens of microseconds) and streams where that wrote a byte clearly
faster in its last few tries (in under FAVOUR of memcpy's time: what memcpy
leaves in the caches helps the readers in calm stretches, which the writer's
clock does not see), trying the other method now and then to notice a change.
Nor does that clock see a reader slowed in the same stretches, copying bytes out
of the writer's cache: a two-rank chain broadcast of 1 MiB, its 256 KiB chunks
through the ring, took 93 µs a call by memcpy and 48 streaming while the writer's
memcpy stayed near its calm time, and the timed choice stayed with memcpy (81 µs;
benchmarks/results/shared-write-w2-epyc-21.md).

A ring's large messages (transport/shm.py: one piece of up to 1 MiB, written by
the ring helper's put, whose whole time is what is compared; larger ones in
chunks) are chosen for alike, one SharedWriter a ring. A message gathered from
many buffers (a ByteStream: broadcast_state's tensors at two ranks) has a second
one, whose samples are whole messages, every chunk of one written the same way:
a chunk's time per byte tells how small its buffers were (with the ring's writer
and chunk times, 300 small tensors took up to 1.4x as long), while a state synced
again is the same buffers every call. In a slow stretch the root's memcpy of 81 small
tensors (1.5 MB) into the ring took 13x its calm time (one profiled run), and in the
blocks of a benchmark run that fell in one syncs took 314-770 µs by memcpy and 171-216
with the timed choice (streaming); in calm stretches it keeps
to memcpy (syncs 1.03x memcpy's time, the median of 14 runs' ratios;
benchmarks/results/small-messages.md).

Pieces under MIN_BYTES are copied by memcpy: their times are too short to tell
the two apart, and streaming them only pushes them out of the cache. Streaming
needs the optional copy helper (accord/copy_core.c, x86-64); without it, or with
ACCORD_COPY_HELPER=0, every piece is a memcpy.
"""
import time

from ..localcopy import STREAMING, helper_on, stream_copy

MIN_BYTES = 128 << 10       # smaller pieces are always memcpy'd
EXPLORE = 128               # streaming, every EXPLORE-th copy starts a run of memcpy
EXPLORE_MEMCPY = 1024       # memcpy, every EXPLORE_MEMCPY-th one a run of streaming
                            # (its time barely moves: memcpy's own samples show when
                            # memcpy slows down, streaming's last ones still stand)
RUN = 4                     # ... of this many copies, all timed
SAMPLE = 16                 # otherwise every SAMPLE-th copy is timed (timing every one
                            # cost about 1 µs of Python a copy, against 2 µs for a
                            # 256 KiB memcpy in cache; every 4th, a world-4 all_reduce
                            # of 1 MiB 4-5% in bench_shared_write's blocks)
KEEP = 5                    # the latest times kept per method (their typical one decides)
FAVOUR = 0.5                # streaming is chosen where it takes under this share of
                            # memcpy's time a byte: memcpy keeps what it leaves in the
                            # caches for the readers, which the writer's clock misses
FORCE = None                # "memcpy" or "stream": benchmarks and tests pin a method


def available():
    """Whether streaming stores can be chosen here: the copy helper is built, streams on
    this CPU, and is not turned off with ACCORD_COPY_HELPER=0."""
    return helper_on() and bool(STREAMING)


def _typical(xs):
    """The mean of the times left once the highest and the lowest are set aside (with
    three or more): one copy the scheduler interrupted, or one that found its bytes
    out of every cache, moves it little, and neither decides alone."""
    if len(xs) < 3:
        return sum(xs) / len(xs)
    return (sum(xs) - max(xs) - min(xs)) / (len(xs) - 2)


class SharedWriter:
    """One writer's choice between memcpy and streaming stores (see the module's text),
    for one stretch of shared memory (a rank's slot, one ring).

    A time counts only where the two copies before it used the same method: a slot's
    bytes come round again every other piece (of the slot's room), a ring's every
    message or two, and what the last write through them left in the caches
    (streaming leaves nothing) changes the next one's cost, so the first memcpy after
    streaming is slower than memcpy in a row.
    The method not in use is therefore tried in runs of RUN copies, every
    EXPLORE-th copy while streaming, every EXPLORE_MEMCPY-th while memcpy'ing (and at
    once, the first time, when memcpy has its first time), and every SAMPLE-th copy
    of the method in use is timed (every one until it has a time).

    clock: seconds as a float (tests pass a fake one)."""

    __slots__ = ("streams", "_times", "_use", "_count", "_run", "_trying", "_last",
                 "_quiet", "_clock")

    def __init__(self, streams=None, clock=time.perf_counter):
        self.streams = available() if streams is None else streams
        self._times = {False: [], True: []}    # streaming? -> latest seconds per byte
        self._use = False                      # the method in use: memcpy at first
        self._count = 0                        # copies outside exploring runs
        self._run = 0                          # copies left in an exploring run
        self._trying = False                   # the method that run uses
        self._last = (None, None)              # the methods of the two copies before
        self._quiet = 0                        # copies left before the next timed one
        self._clock = clock

    def copy(self, dst, src):
        """dst[:] = src, for shared memory peers read (dst: a memoryview of a slot's
        piece or a ring's bytes; src: a bytes-like view of as many bytes)."""
        stream, timed = self.choose(len(dst))
        t0 = self._clock() if timed else 0.0
        if stream:
            stream_copy(dst, src)
        else:
            dst[:] = src
        if timed:
            self.record(stream, (self._clock() - t0) / len(dst))

    def gather(self, dst, stream_of_views, lo):
        """stream_of_views.gather(dst, lo, lo + len(dst)): copy() from a ByteStream
        (broadcast_state's tensors), the same choice."""
        n = len(dst)
        stream, timed = self.choose(n)
        t0 = self._clock() if timed else 0.0
        stream_of_views.gather(dst, lo, lo + n, streaming=stream)
        if timed:
            self.record(stream, (self._clock() - t0) / n)

    def choose(self, n):
        """How the next copy of n bytes goes: (whether it streams, whether to time it and
        record() the seconds per byte). Pinned and small copies are not timed, nor a
        copy whose two before used another method (its time would tell of them)."""
        if n < MIN_BYTES or not self.streams:
            return False, False
        force = FORCE
        if force is not None:
            return force == "stream", False
        if self._quiet:                 # the method in use, between two timed copies
            self._quiet -= 1
            if not self._quiet:         # (SAMPLE - 1 >= 2 of them in a row)
                self._last = (self._use, self._use)
            return self._use, False
        if self._run:
            self._run -= 1
            stream, timed = self._trying, True
        else:
            k = self._count = self._count + 1
            use, times = self._use, self._times
            if k % (EXPLORE if use else EXPLORE_MEMCPY) == 0 or \
                    times[use] and not times[not use]:
                # the other method in its turn, or at once where only this one was timed
                self._trying = stream = not use
                self._run = RUN - 1
                timed = True
            elif not times[use]:
                stream, timed = use, True
            else:
                # timed now; the next SAMPLE - 1 (no exploring run among them: EXPLORE
                # and EXPLORE_MEMCPY are multiples of SAMPLE) go by the quick path above
                stream, timed = use, k % SAMPLE == 0
                if timed:
                    self._quiet = SAMPLE - 1
                    self._count = k + SAMPLE - 1
        last = self._last
        self._last = (last[1], stream)
        return stream, timed and last == (stream, stream)

    def record(self, stream, took):
        """A timed copy's seconds per byte; the method in use decided again outside
        exploring runs."""
        times = self._times[stream]
        times.append(took)
        if len(times) > KEEP:
            del times[0]
        if not self._run:
            use = self._faster()
            if use is not self._use:
                self._use = use
                self._quiet = 0         # the quick path goes on with the method in use

    def _faster(self):
        """Whether streaming wrote a byte in under FAVOUR of memcpy's time in the latest
        tries (each method's _typical); the method in use while either has none."""
        plain, stream = self._times[False], self._times[True]
        if not plain or not stream:
            return self._use
        return _typical(stream) < FAVOUR * _typical(plain)

    @property
    def streaming(self):
        """The method the next copy outside an exploring run uses (True: streaming)."""
        return self._use
