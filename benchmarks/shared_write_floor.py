"""Writing bytes another CPU reads, without accord: memcpy against streaming stores, second by second.

    .venv/bin/python benchmarks/shared_write_floor.py [--seconds 10] [--size 1M]

Two processes, pinned to CPUs 0 and 1, share a buffer of two halves. The writer
fills one half (SIZE bytes), raises a counter, and goes on to the other half once
the reader has copied out the half before it; the reader spins on the counter
and copies each half out as it comes. That is what a ring or a shared slot does
with a large message (transport/shm.py, transport/slots.py): the writer comes
back to bytes its reader's cache still holds. Blocks of 50 writes alternate
between memcpy (numpy's copy) and streaming stores (the copy helper's
stream_copy: accord/copy_core.c), and for each second the median write time of
each is printed, with the load average.

On the 2-vCPU development VM memcpy took 18-20 µs a MiB in some stretches and
98-125 µs in others, seconds long, while streaming stores took 24-25 µs in both
(transport/shared_write.py, which times the two as accord writes and uses the
faster, tells the whole story). Needs the copy helper (pip install with a C
compiler) and two CPUs.
"""
import argparse
import mmap
import os
import statistics
import time

import numpy as np


def parse_size(text):
    text = text.strip().upper()
    for suffix, k in (("K", 1 << 10), ("M", 1 << 20)):
        if text.endswith(suffix):
            return int(text[:-1]) * k
    return int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--size", default="1M", help="bytes a write (default 1M)")
    args = ap.parse_args()
    try:
        from accord.copy_core import stream_copy
    except ImportError:
        raise SystemExit("the copy helper (accord/copy_core.c) is not built here")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two CPUs")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    n = parse_size(args.size)
    mem = mmap.mmap(-1, 4096 + 2 * n)
    flags = np.frombuffer(mem, np.int64, 2, 0)          # [written, read]
    buf = np.frombuffer(mem, np.uint8, 2 * n, 4096)
    src = np.ones(n, np.uint8)
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {cpus[1]})
        dst = np.empty(n, np.uint8)
        seen = 0
        while True:
            while flags[0] == seen:
                pass
            seen = int(flags[0])
            if seen < 0:
                os._exit(0)
            half = (seen % 2) * n
            dst[:] = buf[half:half + n]
            flags[1] = seen
    try:
        os.sched_setaffinity(0, {cpus[0]})
        print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
        print("second  memcpy µs  streaming µs  (median write of SIZE bytes)")
        k = 0
        for second in range(args.seconds):
            plain, streamed = [], []
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                k += 1
                half = (k % 2) * n
                while flags[1] < k - 2:         # the reader is done with this half
                    pass
                streaming = (k // 50) % 2 == 1
                t0 = time.perf_counter()
                if streaming:
                    stream_copy(buf[half:half + n], src)
                else:
                    buf[half:half + n] = src
                (streamed if streaming else plain).append(time.perf_counter() - t0)
                flags[0] = k
            print(f"{second:6d}  {statistics.median(plain) * 1e6:9.1f}  "
                  f"{statistics.median(streamed) * 1e6:12.1f}", flush=True)
        print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    finally:
        flags[0] = -1
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
