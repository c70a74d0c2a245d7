"""The launcher's console rules (``launch/_output.py``): prefixes after every ``\\r``, no two
children's bytes on one line, partial lines shown as they come, pipes read as bytes arrive."""
from __future__ import annotations

import io
import os
import threading

from pskv.launch._output import Console, Output, _Source


def outputs(n: int = 2) -> tuple[io.StringIO, list[Output]]:
    console = Console()
    return io.StringIO(), [Output(f"[worker {i}] ", console, threading.Event(), None)
                           for i in range(n)]


def test_carriage_returns_keep_the_prefix() -> None:
    stream, (w0, _) = outputs()
    src = _Source()
    for text in ("\r 10%|#", "         |", "\r 50%|#####     |", "\r100%|##########|", "\n"):
        w0.show(src, stream, text)
    assert stream.getvalue() == ("[worker 0]  10%|#         |\r[worker 0]  50%|#####     |"
                                 "\r[worker 0] 100%|##########|\n")


def test_two_children_never_share_a_line() -> None:
    stream, (w0, w1) = outputs()
    a, b = _Source(), _Source()
    w0.show(a, stream, "\r 10%")
    w1.show(b, stream, "loss 0.5\n")        # ends worker 0's open bar first
    w0.show(a, stream, "\r 20%")           # a new prefixed line for the bar
    w0.show(a, stream, "\n")
    w1.show(b, stream, "\n")                # a child's own empty line keeps its prefix
    assert stream.getvalue() == ("[worker 0]  10%\n[worker 1] loss 0.5\n[worker 0]  20%\n"
                                 "[worker 1] \n")


def test_a_line_ended_by_another_child_is_not_ended_twice() -> None:
    stream, (w0, w1) = outputs()
    a, b = _Source(), _Source()
    w0.show(a, stream, "abc")               # an unbuffered print: text, then newline
    w1.show(b, stream, "xyz\n")
    w0.show(a, stream, "\n")
    w0.show(a, stream, "next\n")
    assert stream.getvalue() == "[worker 0] abc\n[worker 1] xyz\n[worker 0] next\n"


def test_stdout_and_stderr_of_children_share_the_console() -> None:
    out, err = io.StringIO(), io.StringIO()
    _, (w0, w1) = outputs()
    w1.console = w0.console
    w0.show(_Source(), err, "\r 30%")
    w1.show(_Source(), out, "hello\n")
    assert err.getvalue() == "[worker 0]  30%\n" and out.getvalue() == "[worker 1] hello\n"


def test_pump_passes_bytes_on_as_they_come_and_ends_the_last_line() -> None:
    stream, (w0, _) = outputs()
    log = io.StringIO()
    w0.log = log
    r, w = os.pipe()
    done = threading.Thread(target=w0.pump, args=(os.fdopen(r, "rb", buffering=0), stream,
                                                  False))
    done.start()
    os.write(w, "\r 1/2 é".encode()[:-1])   # half a UTF-8 character
    os.write(w, "\r 1/2 é".encode()[-1:] + b"\r 2/2")
    os.close(w)
    done.join(10)
    assert not done.is_alive()
    assert stream.getvalue() == "[worker 0]  1/2 é\r[worker 0]  2/2\n"
    assert log.getvalue() == "\r 1/2 é\r 2/2\n"
