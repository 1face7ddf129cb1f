"""How `accord run` passes on its ranks' output: whole lines, each tagged with its rank.

Each rank's stdout and stderr are pipes that a _Pump thread in the launcher
reads. A pump writes only complete lines (a partial line waits for its end,
or for the pipe to close), each prefixed "[rank N] ", to the launcher's own
stdout or stderr, under one lock shared by every pump and by the launcher's
own messages: lines of different ranks never mix, whatever the ranks' writes
looked like (Python's print() makes one write per argument when output is
unbuffered, which is where mid-line interleaving came from).

With a log directory, every line also goes, without the prefix, to
DIR/rank-N.log (stdout and stderr together, in the order they were read).
"""
import os
import sys
import threading
from typing import BinaryIO, Optional

# The lock every writer to the launcher's stdout/stderr holds, so that lines stay whole.
LOCK = threading.Lock()
# A line longer than this is passed on in pieces rather than held back unbounded.
MAX_LINE = 1 << 16
READ_SIZE = 1 << 16


def binary(stream) -> Optional[BinaryIO]:
    """The binary layer under a text stream (sys.stdout.buffer), or None."""
    return getattr(stream, "buffer", None)


def say(text: str, stream=None) -> None:
    """Write text (whole lines) to the launcher's stderr, between other ranks' lines."""
    stream = sys.stderr if stream is None else stream
    with LOCK:
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):   # stderr closed or a broken pipe: nowhere to say it
            pass


class RankLog:
    """DIR/rank-N.log: every line one rank wrote (both streams), without a prefix."""

    def __init__(self, directory: str, rank: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank-{rank}.log")
        self._file = open(self.path, "wb")
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            try:
                self._file.write(data)
                self._file.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        with self._lock:
            try:
                self._file.close()
            except OSError:
                pass


class Pump(threading.Thread):
    """Copies one pipe of one rank to the launcher's stream, a whole line at a time."""

    def __init__(self, fd: int, out, prefix: str, log: Optional[RankLog], name: str):
        super().__init__(daemon=True, name=name)
        self.fd, self.out, self.log = fd, out, log
        self.prefix = prefix.encode()
        self._raw = binary(out)
        self._broken = False     # the launcher's stream is gone: keep draining, stop writing

    def run(self) -> None:
        pending = b""
        try:
            while True:
                try:
                    chunk = os.read(self.fd, READ_SIZE)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                data = pending + chunk
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) >= MAX_LINE:
                    data, cut = data + b"\n", len(data) + 1
                if cut:
                    self._emit(data[:cut])
                pending = data[cut:]
            if pending:
                self._emit(pending + b"\n")   # the rank ended without a final newline
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass

    def _emit(self, block: bytes) -> None:
        """block: one or more lines, each ending in b'\\n'."""
        if self.log is not None:
            self.log.write(block)
        if self.prefix:
            lines = block[:-1].split(b"\n")
            sep = b"\n" + self.prefix
            block = self.prefix + sep.join(lines) + b"\n"
        if self._broken:
            return
        with LOCK:
            try:
                if self._raw is not None:
                    self._raw.write(block)
                    self._raw.flush()
                else:
                    self.out.write(block.decode(errors="replace"))
                    self.out.flush()
            except (OSError, ValueError):
                self._broken = True
