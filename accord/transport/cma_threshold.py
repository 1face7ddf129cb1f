"""The single-copy threshold of a shared-memory group, measured where none is set.

From what size a message goes single-copy (`process_vm_readv`) rather than
through the pair's ring depends on the machine: on the AMD EPYC guests accord
was tuned on the rings were faster up to 4 MiB, both cores copying; on an
Intel Xeon guest a 1 MiB broadcast took 87 µs through them and 42 µs split
single-copy. A copy inside one process does not tell the two apart (single
copy reads at about half memcpy's speed on both); moving bytes between two
ranks does. So when ACCORD_SHM_CMA is not set, group ranks 0 and 1 swap
1 MiB both ways at once (a step of all_gather or all_reduce) when the group is
created, through the rings and single-copy in turn, seven times each (a few
milliseconds); single copy is chosen where the median of its times over the ring
swap's just before it is at most WIN. The rings are mapped in before (shm.py's
populate): cold, a ring swap took 4-8x a warm one on the AMD guest, which made
single copy look better than it is, and the verdict changed from run to run. Rank
0's verdict goes to every rank through the store: all
ranks of a group use the same threshold, which the algorithms that choose
single copy for the whole group need. A process measures once; its later
groups reuse its verdict.
"""
import time

import numpy as np

from .wire import OP_CODES, SEQ_MASK, Stamp

PROBE_BYTES = 1 << 20
LOW = 1 << 20           # single copy from here where it won the probe
HIGH = 4 << 20          # ... else from here (the rings faster below it)
ROUNDS = 7              # probes of each kind, alternating
WIN = 0.75              # single copy must take at most this share of the rings' time
                        # (AMD EPYC guest, warm rings: medians 0.80-1.10 in eight group
                        # creations, while a 1 MiB all_gather took 1.2-1.9x the rings'
                        # time single-copy in paired rounds; an Intel Xeon guest gave
                        # 0.65-0.78 against cold rings, not measured since)
_verdict = []           # this process's, once measured or learnt


def choose(t, store, key, rank, deadline):
    """The threshold for transport t of group rank `rank` (every rank of the group
    calls it while creating the group; ranks 0 and 1 measure unless rank 0's process
    already knows). key: the group's store prefix."""
    if not t.cma_everywhere or t.size < 2:
        return HIGH                 # no single copy anyway
    if rank == 0:
        store.set(f"{key}/cma", str(_verdict[0]) if _verdict else "measure")
    said = _text(store.get(f"{key}/cma"))
    if said != "measure":
        value = int(said)
    else:
        if rank == 0:
            try:
                value = _measure(t, deadline)
            except BaseException:
                # rank 1 is gone (or this rank interrupted): the others must not wait
                # for a verdict; the group's creation fails here and at rank 1
                store.set(f"{key}/cma/verdict", str(HIGH))
                raise
            store.set(f"{key}/cma/verdict", str(value))
        elif rank == 1:
            _answer(t, deadline)
        value = int(_text(store.get(f"{key}/cma/verdict")))
    if not _verdict:
        _verdict.append(value)
    return value


def _text(v):
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


# a stamp no call of the group ever has (its sequence numbers start at 0)
_STAMP = Stamp(OP_CODES["broadcast"], SEQ_MASK, 0, 0, 0, PROBE_BYTES, "uint8")


def _measure(t, deadline):
    """Rank 0: swap the probe with rank 1 both ways at once (what a step of all_gather
    or all_reduce does) through the rings and single-copy in turn; the threshold from
    the best times."""
    return _probe(t, 1, deadline)


def _answer(t, deadline):
    """Rank 1: the same swaps."""
    _probe(t, 0, deadline)


def _probe(t, peer, deadline):
    out = np.ones(PROBE_BYTES, np.uint8)
    into = np.empty(PROBE_BYTES, np.uint8)
    send, recv = memoryview(out), memoryview(into)
    saved, t.cma_min = t.cma_min, PROBE_BYTES
    took = {True: [], False: []}
    try:
        for i in range(2 * ROUNDS + 2):
            ring = i % 2 == 0
            t0 = time.perf_counter()
            t.exchange([(peer, send)], [(peer, recv)], _STAMP, deadline, ring=ring)
            if i >= 2:                  # the first of each warms up
                took[ring].append(time.perf_counter() - t0)
    finally:
        t.cma_min = saved
    # each single-copy swap against the ring swap just before it, the median of those
    # ratios: a burst of load on the shared machine moves one pair, not the verdict
    ratios = sorted(c / r for r, c in zip(took[True], took[False]))
    return LOW if ratios[len(ratios) // 2] <= WIN else HIGH
