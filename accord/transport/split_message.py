"""A large single-copy message copied by its receiver and its sender at once.

A single-copy message (transport/shm.py's descriptor: the sender's buffer address
and an acknowledgement number in the ring) is read by its receiver with
process_vm_readv while the sender only waits for the acknowledgement. Where the
sender is inside its wait loop anyway, it writes the back of the message into the
receiver's buffer with process_vm_writev meanwhile: both cores copy. Nothing waits
for the sender's help: a sender busy elsewhere, or asleep past the receiver's copy,
leaves the receiver to copy all of it, as before.

Only where every rank of the group has a core (shm.py decides): with more ranks
than cores the sender's help takes the core another rank's copy needs.

Few large copies, not many small ones: on the 2-vCPU development VM a 4 MiB
process_vm_readv took 420-470 µs in one call and 580-620 in 16 calls of 256 KiB
(about 11 µs a call more), and a 4 MiB message split in halves 225-250 µs, in 256 KiB
calls taken in turn 300 (benchmarks/split_copy_floor.py measures the halves). So the
receiver claims the front half first and the sender, arriving, the rest of what it
estimates the receiver will not have reached; whatever is left between them, each
then claims half of, down to MIN_UNITS.

The words, in the control page of the sender-to-receiver channel (a number below
is the message's acknowledgement number in the high bits, units of UNIT bytes in
the low SHIFT bits):

- DEST, START (receiver): its buffer's address, and when it began
  (time.monotonic_ns, one clock for every process of the host);
- RECV (receiver): the end of the units it copies ([0, RECV)), or CLOSED once it
  copies no more;
- CLAIM, DONE (sender): the start of the units it copies, and of those written;
- BUSY (sender): the number while it may write into the receiver's buffer, else 0.

Every byte arrives: the receiver copies its claims except what DONE says the sender
wrote, and stops only once its claims reach DONE; claims are hints that keep the
two apart (where they cross, a unit is copied by both, with the same bytes).

No write after the receive completes: the receiver stores CLOSED, fences, and
waits while BUSY holds the message's number; the sender stores BUSY, fences, and
reads RECV before each write, and stops at CLOSED. Of two such store-fence-load
sequences at least one sees the other's store, so either the sender sees CLOSED and
writes nothing more, or the receiver sees BUSY and waits for the write to end. Only
then does the receiver acknowledge, and the send complete.

That wait is for one write call of the sender's (at most what it claimed, under a
millisecond here), which nothing but a stop of the sender's process (SIGSTOP, a
debugger) can stretch: the receiver then waits until the sender goes on, its
receive's timeout notwithstanding, since a receive that returned would leave its
buffer open to the stopped write. A sender that dies ends the wait (it writes no
more, and the receiver has every byte); one that aborted does not (its thread may
still be in the write).
"""
import os
import time

from . import cma, futex

UNIT = 64 << 10             # claims are in these
MIN_UNITS = 4               # no claim below 256 KiB but the last
SHIFT = 24                  # a word: number << SHIFT | units
MASK = (1 << SHIFT) - 1
CLOSED = MASK               # RECV once the receiver is done: past every unit
RATE = 8                    # bytes a ns one side copies alone, to estimate where the
                            # receiver is (4 and 16 MiB read alone at 7-10 on the VM)
_CHECK_S = 0.01             # how often a receiver waiting for a writing sender looks for
                            # its death

# byte offsets in a channel's control page (transport/shm.py's _C_* words end at 456);
# the receiver's words share one cache line, the sender's another
_C_DEST, _C_START, _C_RECV = 512, 520, 528
_C_CLAIM, _C_DONE, _C_BUSY = 576, 584, 592


class Words:
    """The int64 indices of one channel's words in its arena (chan: the channel's
    byte offset)."""
    __slots__ = ("dest", "start", "recv", "claim", "done", "busy")

    def __init__(self, chan):
        self.dest, self.start, self.recv = ((chan + c) // 8 for c in (_C_DEST, _C_START,
                                                                      _C_RECV))
        self.claim, self.done, self.busy = ((chan + c) // 8 for c in (_C_CLAIM, _C_DONE,
                                                                      _C_BUSY))


def wanted():
    """Whether this process's receives ask their senders for help: yes, unless
    ACCORD_SHM_SPLIT=0 (the receiver then copies alone, to compare the two). Read when
    a group's shared-memory links are made; only the receiver's setting counts."""
    return os.environ.get("ACCORD_SHM_SPLIT", "1").strip() != "0"


def units(n):
    """How many claim units an n-byte message has."""
    return -(-n // UNIT)


def applies(n):
    """Whether an n-byte single-copy message is worth splitting."""
    return n >= 2 * MIN_UNITS * UNIT and units(n) < CLOSED - 1


def _value(word, seq, otherwise):
    """A word's units where it speaks of message seq, else otherwise."""
    return word & MASK if word >> SHIFT == seq else otherwise


def receive(link, dest, src, n, seq):
    """The receiver's side: copy n bytes from the sender's address src into this
    process's address dest, while the sender may copy some of them. Returns once
    every byte is here and the sender will write no more; the caller then
    acknowledges seq. OSError where a copy fails."""
    q, w = link.t.q, link.i_coop
    tag = seq << SHIFT
    total = units(n)
    q[w.dest] = dest
    q[w.start] = time.monotonic_ns()
    lo, hi = 0, (total + 1) // 2            # the front half first
    q[w.recv] = tag | hi
    futex.fence()
    if q[link.i_want_ack_i]:
        # the sender sleeps until the acknowledgement: wake it to help
        futex.add_and_wake(link.peer_doorbell, link.wake_n)
    pid = link.pid
    try:
        while True:
            end = min(hi, _value(q[w.done], seq, total))
            if end > lo:
                cma.read(pid, dest + lo * UNIT, src + lo * UNIT, min(end * UNIT, n) - lo * UNIT)
            lo = hi
            done = _value(q[w.done], seq, total)
            if lo >= done:
                return
            claim = _value(q[w.claim], seq, total)
            if claim >= total:
                hi = done                   # the sender never came: the rest at once
            else:
                gap = min(claim, done) - lo
                hi = min(done, lo + max(MIN_UNITS, (gap + 1) // 2))
            q[w.recv] = tag | hi
            futex.fence()
    finally:
        q[w.recv] = tag | CLOSED
        futex.fence()
        if q[w.busy] == seq:
            _await_sender(link, seq)


def _await_sender(link, seq):
    """Wait while the sender writes a range it claimed (at most one: it looks at
    RECV before the next). A sender that died writes nothing more: the wait ends
    (every byte is here already, the receiver having copied whatever the sender had
    not said it wrote). One that aborted may still be inside its write: the wait
    goes on (the caller then reports the abort)."""
    t, q, i = link.t, link.t.q, link.i_coop.busy
    check = time.monotonic() + _CHECK_S
    while q[i] == seq:
        os.sched_yield()
        if time.monotonic() >= check:
            if link.peer in t._dead_peers():
                return
            check = time.monotonic() + _CHECK_S


def asked(link, seq):
    """Whether the receiver of this rank's single-copy message seq copies it now and
    takes help."""
    r = link.t.q[link.o_coop.recv]
    return r >> SHIFT == seq and r & MASK != CLOSED


def assist(link, seq, src, n):
    """The sender's side of message seq (n bytes at this process's address src),
    from its wait for the acknowledgement, once asked(): write ranges from the back
    into the receiver's buffer until meeting the receiver. True if it wrote any.
    OSError where a write fails (the receiver died: the caller's liveness checks
    name it)."""
    q, w = link.t.q, link.o_coop
    tag = seq << SHIFT
    hi = units(n)
    dest, start, pid = q[w.dest], q[w.start], link.pid
    wrote = False
    try:
        while True:
            r = _value(q[w.recv], seq, CLOSED)
            if r >= hi:
                return wrote                # the receiver has the rest, or closed
            # half of what lies between where the receiver is likely to be (alone, at
            # RATE since it began) and what this side has not claimed
            at = min(r, (time.monotonic_ns() - start) * RATE // UNIT)
            lo = min(hi - 1, max(r, (at + hi + 1) // 2))
            q[w.claim] = tag | lo
            q[w.busy] = seq
            futex.fence()
            # (the number too: the receiver may have acknowledged seq and gone on to the
            # next message, whose buffer DEST may be now)
            r = _value(q[w.recv], seq, CLOSED)
            if r >= hi:
                return wrote
            lo = max(lo, r)
            cma.write(pid, src + lo * UNIT, dest + lo * UNIT, min(hi * UNIT, n) - lo * UNIT)
            futex.fence()                   # the bytes before the word that says so
            wrote = True
            hi = lo
            q[w.done] = tag | hi
    finally:
        q[w.busy] = 0
