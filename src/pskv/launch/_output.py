"""The launcher's console: every child's output, prefixed, live, never mixed mid-line.

Each child's stdout and stderr are read as bytes arrive (not a line at a time), so a
partial line, such as a carriage-return progress bar (tqdm's ``\\r 40%|####  |``), shows as
it is drawn, as torchrun shows it. Rules, all under one lock shared by every child:

* every line on the console starts with its child's prefix (``[worker 1] ``); after a
  ``\\r`` the prefix is written again, so a redrawn bar keeps it;
* a child's partial line stays open on the console until another child has something to
  show; that child first ends the open line (``\\n``), and the first child's next piece
  starts a new prefixed line: two children's bytes never share a line;
* a piece that ends mid-line waits up to :data:`HOLD_S` for the rest of its line (an
  unbuffered ``print`` writes its text and its newline in two writes), so whole lines stay
  whole while a bar still redraws many times a second;
* each child's output also goes, as written and unprefixed, to ``--log-dir``.

After Ctrl-C, stderr is held back; at the end a held Python traceback is shown as its last
line only (the full text stays in the log file). A console that breaks is reported once and
the pipes are drained anyway, so no child blocks on a full pipe.
"""
from __future__ import annotations

import codecs
import logging
import os
import re
import select
import threading
import time
from typing import IO, TextIO

__all__ = ["CHUNK", "Console", "HOLD_S", "Output"]

logger = logging.getLogger(__name__)

#: the most read from a pipe at once (a reader's memory is bounded)
CHUNK = 1 << 16
#: seconds a partial line waits for the rest of its line before it is shown
HOLD_S = 0.02
_HELD_MAX = 10_000  # lines of stderr held back after Ctrl-C (the rest pass through)
_PIECES = re.compile(r"[^\r\n]*[\r\n]|[^\r\n]+")


class Console:
    """What every child's output shares: the lock, and whose line is open (not ended).

    ``open`` is ``(source, stream)`` of the piece of output whose line was left unended
    on the console, or None when the console is at the start of a line.
    """

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock or threading.Lock()
        self.open: tuple[object, TextIO] | None = None


class _Source:
    """One pipe's place in its line: whether its line is partly written, and whether a
    ``\\r`` sent the cursor back to where its prefix must be written again."""

    __slots__ = ("partial", "fresh")

    def __init__(self) -> None:
        self.partial = False
        self.fresh = False


class Output:
    """Where one process's output goes: the console (prefixed) and, optionally, a log file.

    Parameters
    ----------
    prefix : str
        ``"[worker 1] "``.
    console : Console
        Shared by every child of the job.
    interrupted : threading.Event
        Set after Ctrl-C: stderr is held back from then on.
    log : text file, optional
        The child's log file (``--log-dir``).
    """

    def __init__(self, prefix: str, console: Console, interrupted: threading.Event,
                 log: IO[str] | None) -> None:
        self.prefix, self.console, self.interrupted, self.log = prefix, console, interrupted, log
        self._broken = False

    # ---- the console -------------------------------------------------------------------
    def _write(self, stream: TextIO, text: str) -> None:
        """Write under the console lock; a broken console is reported once."""
        if self._broken:
            return
        try:
            stream.write(text)
        except (OSError, ValueError) as err:
            self._broken = True
            logger.warning("cannot write the output of %s (%s); discarding it",
                           self.prefix.strip(), err)

    def show(self, source: _Source, stream: TextIO, text: str) -> None:
        """Put ``text`` (any piece of one pipe's output) on the console by the rules above."""
        console = self.console
        with console.lock:
            for piece in _PIECES.findall(text):
                end = piece[-1] if piece[-1] in "\r\n" else ""
                body = piece[:-1] if end else piece
                mine = console.open is not None and console.open[0] is source
                if body:
                    if not mine:
                        self._end_open_line()
                        self._write(stream, self.prefix)
                    elif source.fresh:
                        self._write(stream, self.prefix)
                    self._write(stream, body)
                    source.partial, source.fresh = True, False
                    console.open = (source, stream)
                    mine = True
                if end == "\n":
                    if mine:
                        self._write(stream, "\n")
                    elif not source.partial:          # a child's empty line
                        self._end_open_line()
                        self._write(stream, self.prefix + "\n")
                    # else: the rest of a line another child already ended
                    source.partial = source.fresh = False
                    if mine:
                        console.open = None
                elif end == "\r" and mine:
                    self._write(stream, "\r")
                    source.fresh = True
                # a "\r" with nothing of this child's on the line: nothing to redraw
            self._flush(stream)

    def _end_open_line(self) -> None:
        """End the line another piece of output left open (caller holds the lock)."""
        opened = self.console.open
        if opened is not None:
            try:
                opened[1].write("\n")
                opened[1].flush()
            except (OSError, ValueError):
                pass
            self.console.open = None

    def _flush(self, stream: TextIO) -> None:
        if not self._broken:
            try:
                stream.flush()
            except (OSError, ValueError) as err:
                self._broken = True
                logger.warning("cannot write the output of %s (%s); discarding it",
                               self.prefix.strip(), err)

    def finish(self, source: _Source, stream: TextIO) -> None:
        """The pipe ended: end its line if it is still open."""
        with self.console.lock:
            opened = self.console.open
            if opened is not None and opened[0] is source:
                self._write(stream, "\n")
                self._flush(stream)
                self.console.open = None

    # ---- the pipe ----------------------------------------------------------------------
    def pump(self, pipe: IO[bytes], stream: TextIO, is_stderr: bool) -> None:
        """Copy ``pipe`` as its bytes arrive; drain it even when the console breaks."""
        source = _Source()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        held: list[str] = []
        held_lines = 0
        ended_nl = True
        with pipe:
            fd = pipe.fileno()
            while True:
                data = _read(fd, CHUNK)
                if not data:
                    break
                text = decoder.decode(data)
                # mid-line: give the rest of the line a moment to come (bounded)
                hold_end = time.monotonic() + HOLD_S
                while text and not text.endswith("\n") and len(text) < CHUNK:
                    left = hold_end - time.monotonic()
                    if left <= 0 or not select.select([fd], [], [], left)[0]:
                        break
                    more = _read(fd, CHUNK)
                    if not more:
                        break
                    text += decoder.decode(more)
                if not text:
                    continue
                ended_nl = text.endswith("\n")
                if self.log is not None:
                    with self.console.lock:
                        self.log.write(text)
                        self.log.flush()
                if is_stderr and self.interrupted.is_set() and held_lines < _HELD_MAX:
                    held.append(text)
                    held_lines += text.count("\n")
                else:
                    self.show(source, stream, text)
        tail = decoder.decode(b"", final=True)
        if tail:
            ended_nl = False
            if self.log is not None:
                with self.console.lock:
                    self.log.write(tail)
            self.show(source, stream, tail)
        if self.log is not None and not ended_nl:
            with self.console.lock:
                self.log.write("\n")
                self.log.flush()
        self.finish(source, stream)
        self._show_held(source, stream, "".join(held))

    def _show_held(self, source: _Source, stream: TextIO, text: str) -> None:
        lines = text.splitlines(keepends=True)
        if any(t.startswith("Traceback (most recent call last)") for t in lines):
            last = [t for t in lines if t.strip()][-1]
            self.show(source, stream,
                      f"{last.rstrip()} (after Ctrl-C; {len(lines) - 1} more lines hidden)\n")
        elif text:
            self.show(source, stream, text if text.endswith("\n") else text + "\n")


def _read(fd: int, size: int) -> bytes:
    """What the pipe has (at most ``size`` bytes; b"" at its end)."""
    while True:
        try:
            return os.read(fd, size)
        except InterruptedError:   # pragma: no cover - PEP 475 retries already
            continue
        except OSError:
            return b""
