"""The launcher's output: every process's stdout and stderr copied line by line
to the launcher's own, each line prefixed with the process's rank."""

from __future__ import annotations

import dataclasses
import os
import selectors
import time
from collections.abc import Callable
from typing import IO, TextIO

from jaxdist.launch.gloo import HINTS as GLOO_HINTS
from jaxdist.launch.gloo import GlooFilter

NAME = "jaxdist.launch"
POLL_INTERVAL = 0.05  # seconds between checks of the processes while copying their output
_MAX_LINE = 1 << 16  # a longer line without a newline is copied in pieces


@dataclasses.dataclass
class _Pipe:
    """One process's stdout or stderr, and the part of a line read from it so far."""

    pipe: IO[bytes]
    sink: TextIO
    prefix: bytes
    pending: bytes = b""
    watch: Callable[[str], None] | None = None  # sees each of its lines that jaxdist wrote
    gloo: GlooFilter = dataclasses.field(default_factory=GlooFilter)


class Output:
    """Copies the processes' output to the launcher's streams, whole lines at a time.

    Everything runs in the launcher's main thread (a selector, no reader threads), so
    lines can never mix; a line longer than 64 KiB without a newline is cut. Gloo's
    connection lines are left out unless ``gloo``, also where their pieces fall between
    the pieces of another line (`jaxdist.launch.gloo`).
    """

    def __init__(self, stdout: TextIO, stderr: TextIO, *, gloo: bool = False) -> None:
        self.stdout, self.stderr = stdout, stderr
        self.gloo = gloo  # copy Gloo's connection lines (left out by default)
        self._broken: set[int] = set()  # ids of streams whose reader went away
        self._selector = selectors.DefaultSelector()

    def add(
        self,
        pipe: IO[bytes],
        sink: TextIO,
        prefix: bytes,
        watch: Callable[[str], None] | None = None,
    ) -> None:
        """Copies ``pipe`` to ``sink``; ``watch`` also gets each of its lines that holds
        ``jaxdist: `` (decoded, without the prefix)."""
        self._selector.register(pipe, selectors.EVENT_READ, _Pipe(pipe, sink, prefix, watch=watch))

    def write(self, sink: TextIO, data: bytes) -> None:
        if id(sink) in self._broken:
            return
        try:
            sink.flush()
            buffer: IO[bytes] | None = getattr(sink, "buffer", None)
            if buffer is None:
                sink.write(data.decode(errors="replace"))
                sink.flush()
            else:
                buffer.write(data)
                buffer.flush()
        except (BrokenPipeError, ValueError):  # closed by the reader: keep supervising
            self._broken.add(id(sink))

    def message(self, text: str) -> None:
        self.write(self.stderr, f"{NAME}: {text}\n".encode())

    def pump(self, timeout: float) -> None:
        """Copies what the processes wrote, waiting up to ``timeout`` seconds for something."""
        if not self._selector.get_map():
            time.sleep(timeout)
            return
        ready = self._selector.select(timeout)
        for key in self._selector.get_map().values():  # no next line came: copy a held one
            if key.data.gloo.held is not None and all(key is not k for k, _ in ready):
                self._copy(key.data, key.data.gloo.release())
        for key, _ in ready:
            p: _Pipe = key.data
            chunk = os.read(key.fd, _MAX_LINE)
            if not chunk:
                self._close(p)
                continue
            data = p.pending + chunk
            if not self.gloo:
                data = p.gloo.whole_lines(data)
            cut = data.rfind(b"\n") + 1 or (len(data) if len(data) >= _MAX_LINE else 0)
            p.pending = data[cut:]
            self._emit(p, data[:cut])

    def drain(self, timeout: float) -> None:
        """Copies output until every pipe is closed or ``timeout`` seconds passed; closes all."""
        deadline = time.monotonic() + timeout
        while self._selector.get_map() and time.monotonic() < deadline:
            self.pump(POLL_INTERVAL)
        for key in list(self._selector.get_map().values()):
            self._close(key.data)

    def _emit(self, p: _Pipe, data: bytes) -> None:
        if data:
            lines = data.removesuffix(b"\n").split(b"\n")
            if not self.gloo and (p.gloo.owes or any(w in data for w in GLOO_HINTS)):
                lines = [kept for line in lines for kept in p.gloo.lines(line)]
            self._copy(p, lines)

    def _copy(self, p: _Pipe, lines: list[bytes]) -> None:
        if lines:
            self.write(p.sink, b"".join(p.prefix + line + b"\n" for line in lines))
            if p.watch is not None:
                for line in lines:
                    if b"jaxdist: " in line:
                        p.watch(line.decode(errors="replace"))

    def _close(self, p: _Pipe) -> None:
        self._emit(p, p.pending)
        self._copy(p, p.gloo.release())
        self._selector.unregister(p.pipe)
        p.pipe.close()
