"""How a rank waits for a peer: spin first where it has a core to itself, then sleep.

Shared by both transports. A rank that sleeps as soon as nothing has arrived pays
the kernel's wake-up on every message: on the development VM 4-5 µs through a
futex, about 30 µs through poll() on a loopback socket (a blocking ping-pong of 8
bytes between two Python processes: 32-41 µs half a round trip), where the reply
itself takes a few. So a rank that has a core to itself looks again and again for
a while (SPIN_US) before it sleeps; one that shares its core with another rank of
the group does not, since its spinning would hold off the very rank it waits for.
"""
import os

SPIN_US = 200.0                      # spin this long before sleeping, where every rank
                                     # has a core (none where ranks outnumber cores). Over
                                     # shared memory, with a busy loop of another program
                                     # beside two ranks on two cores, 50 µs left a sleeper
                                     # waiting for the scheduler: the 8-byte all_reduce
                                     # took 122-164 µs in 4 of 5 runs, the barrier
                                     # 127-146 µs in 3 of 5; with 200, 7-27 µs in 4 of 5
                                     # and 4.4-4.6 µs in all 5
                                     # (MPICH, which spins on: 2.9 µs). Its cost: a rank
                                     # waiting 5 ms for a peer's compute burns 0.52 ms of
                                     # CPU a call, 0.30 ms with 50.
SPIN_ACK_US = 1000.0                 # ... and this long for a peer copying a single-copy send
YIELDS = 8                           # sched_yield()s before sleeping, when oversubscribed
YIELD_US = 50.0                      # ... and for at least this long where some core has
                                     # a rank to itself (ranks fewer than twice the
                                     # cores). A sleeper's core then goes idle and wakes
                                     # slowly, and an EEVDF kernel's sched_yield hands the
                                     # core over only once the peer there is owed time, so
                                     # 8 yields may last a few µs: at 3 ranks on 2 cores a
                                     # broadcast_state of 10 tensors took 0.89-0.93x the
                                     # time with the window, the 64 KiB-1 MiB collectives
                                     # 0.56-0.99x. Where every core is shared (4 on 2),
                                     # sleeping sooner frees the core for its other rank:
                                     # the window made the barrier and 1 MiB broadcast
                                     # and scatter 1.15-1.34x slower there (paired
                                     # rounds, benchmarks/results/small-messages.md)


def usable_cores() -> int:
    """How many cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def wait_policy(size: int, ncpu: int):
    """How a rank of `size` ranks on `ncpu` cores waits before it sleeps: (seconds to
    spin, seconds to spin for a peer copying a single-copy send, sched_yield()s, and
    the least seconds to go on yielding).

    With a core each it spins (SPIN_US; SPIN_ACK_US through a peer's copy, rather than
    pay a sleep and a wake-up after it). With more ranks than cores a spinning rank
    takes the core its peer needs: it yields YIELDS times instead, and for YIELD_US
    where some core still has a rank to itself (fewer ranks than twice the cores)."""
    if size <= ncpu:
        return SPIN_US * 1e-6, SPIN_ACK_US * 1e-6, 0, 0.0
    return 0.0, 0.0, YIELDS, (YIELD_US * 1e-6 if size < 2 * ncpu else 0.0)
