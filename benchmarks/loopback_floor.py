"""What loopback TCP itself allows: two processes, one connection, no accord.

    .venv/bin/python benchmarks/loopback_floor.py [--sizes 1M,16M,64M] [--repeat 5]

For each size, the time to move SIZE bytes one way (rank 0 to rank 1, then an
8-byte reply so the sender knows it arrived) and SIZE bytes both ways at once
(what a two-rank all_reduce or all_gather step does), with the socket options
accord's TCP transport uses (TCP_NODELAY, 4 MiB send and receive buffers) and
non-blocking sockets progressed by one loop, as accord's transport does. The
minimum over --repeat runs is printed, with the load average.

A collective over TCP cannot move its bytes faster than this: a two-rank
all_reduce of S bytes moves S each way (S/2 in each of its two steps), a
scatter S/2 one way. Compare `accord bench --transport tcp` rows against it.
"""
import argparse
import os
import select
import socket
import sys
import time

import numpy as np


def parse_size(text):
    text = text.strip().upper()
    for suffix, k in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * k
    return int(text)


def tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    sock.setblocking(False)


def move(sock, out, into):
    """Send all of out and receive all of into at once (either may be empty)."""
    sent = got = 0
    while sent < len(out) or got < len(into):
        moved = False
        if sent < len(out):
            try:
                sent += sock.send(out[sent:])
                moved = True
            except BlockingIOError:
                pass
        if got < len(into):
            try:
                k = sock.recv_into(into[got:], len(into) - got)
                if k == 0:
                    raise ConnectionError("peer closed")
                got += k
                moved = True
            except BlockingIOError:
                pass
        if not moved:
            select.select([sock] if got < len(into) else [],
                          [sock] if sent < len(out) else [], [], 1.0)


def run(sock, rank, sizes, repeat):
    empty = memoryview(bytearray(0))
    ack, ack_in = memoryview(bytearray(8)), memoryview(bytearray(8))
    rows = []
    for n in sizes:
        out = memoryview(np.ones(n, np.uint8))
        into = memoryview(np.empty(n, np.uint8))
        best = {"one way": float("inf"), "both ways": float("inf")}
        for _ in range(repeat):
            move(sock, ack, ack_in)                 # start together
            t = time.perf_counter()
            if rank == 0:
                move(sock, out, empty)
                move(sock, empty, ack_in)
            else:
                move(sock, empty, into)
                move(sock, ack, empty)
            best["one way"] = min(best["one way"], time.perf_counter() - t)
            move(sock, ack, ack_in)
            t = time.perf_counter()
            move(sock, out, into)
            best["both ways"] = min(best["both ways"], time.perf_counter() - t)
        rows.append((n, best))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    load = os.getloadavg()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        server.close()
        sock = socket.create_connection(("127.0.0.1", port))
        tune(sock)
        run(sock, 1, sizes, args.repeat)
        os._exit(0)
    sock, _ = server.accept()
    tune(sock)
    rows = run(sock, 0, sizes, args.repeat)
    os.waitpid(pid, 0)
    print(f"# loopback TCP, one connection, minimum of {args.repeat}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start")
    print(f"{'size':>10}  {'one way ms':>11}  {'GB/s':>6}  {'both ways ms':>13}  "
          f"{'GB/s each way':>13}")
    for n, best in rows:
        one, both = best["one way"], best["both ways"]
        print(f"{n:>10}  {one * 1e3:>11.2f}  {n / one / 1e9:>6.2f}  {both * 1e3:>13.2f}  "
              f"{n / both / 1e9:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
