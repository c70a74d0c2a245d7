"""``pskv-tour``: run the MXNet KVStore tutorial's examples on pskv and print the results.

This is pskv's main job until the training example lands: a new user runs one command and
sees the store aggregate, update and broadcast exactly as the MXNet tutorial shows.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, TextIO

__all__ = ["main", "run_tour"]


def _show(out: TextIO, label: str, arr: Any) -> None:
    print(f"{label}\n{arr.asnumpy()}", file=out)


def _basic(mx: Any, out: TextIO) -> None:
    print("== Basic push and pull (Python tutorial) ==", file=out)
    kv = mx.kv.create("local")
    shape = (2, 3)
    kv.init(3, mx.nd.ones(shape) * 2)
    a = mx.nd.zeros(shape)
    kv.pull(3, out=a)
    _show(out, ">>> kv.init(3, ones*2); kv.pull(3, out=a)", a)
    kv.push(3, mx.nd.ones(shape) * 8)
    kv.pull(3, out=a)
    _show(out, ">>> kv.push(3, ones*8); kv.pull(3, out=a)", a)
    gpus = [mx.gpu(i) for i in range(4)]
    kv.push(3, [mx.nd.ones(shape, gpu) for gpu in gpus])
    kv.pull(3, out=a)
    _show(out, ">>> kv.push(3, [ones on gpu(0..3)])  # summed", a)

    def update(key: Any, input: Any, stored: Any) -> None:
        print(f"update on key: {key}", file=out)
        stored += input * 2

    kv._set_updater(update)
    kv.push(3, mx.nd.ones(shape))
    kv.pull(3, out=a)
    _show(out, ">>> updater stored += input * 2; kv.push(3, ones)", a)
    b = [mx.nd.ones(shape, gpu) for gpu in gpus]
    kv.pull(3, out=b)
    _show(out, ">>> kv.pull(3, out=[4 arrays]); b[1]", b[1])

    keys = [5, 7, 9]
    kv.init(keys, [mx.nd.ones(shape)] * len(keys))
    kv.push(keys, [mx.nd.ones(shape)] * len(keys))
    b = [mx.nd.zeros(shape)] * len(keys)
    kv.pull(keys, out=b)
    _show(out, ">>> keys [5, 7, 9]: init ones, push ones; b[1]", b[1])
    b = [[mx.nd.ones(shape, gpu) for gpu in gpus]] * len(keys)
    kv.push(keys, b)
    kv.pull(keys, out=b)
    _show(out, ">>> push ones from 4 devices to each key; b[1][1]", b[1][1])


def _string_keys(mx: Any, out: TextIO) -> None:
    print("\n== String keys (Clojure and Scala tutorials) ==", file=out)
    kv = mx.kv.create("local")
    shape = (2, 3)
    kv.init(["3"], [mx.nd.ones(shape) * 2])
    a = mx.nd.zeros(shape)
    kv.push(["3", "3", "3"], [mx.nd.ones(shape, mx.cpu(i)) for i in range(3)])
    kv.pull("3", a)
    _show(out, ">>> push ['3', '3', '3'] ones from 3 cpus; a", a)


def _notebook(mx: Any, out: TextIO) -> None:
    print("\n== NumPy-style notebook (kv.create('device')) ==", file=out)
    np = mx.np
    kv = mx.kv.create("device")
    shape = (2, 3)
    kv.init(3, np.ones(shape) * (-2))
    A = np.zeros(shape)
    kv.pull(3, out=A)
    print(f">>> kv.init(3, ones*-2); A\n{A!r}", file=out)
    contexts = [mx.cpu(i) for i in range(3)]
    kv.push(3, [np.ones(shape, ctx=ctx) for ctx in contexts])
    kv.pull(3, out=A)
    print(f">>> push ones from 3 cpus; A\n{A!r}", file=out)
    keys = [7, 11, 13, 17]
    kv.init(keys, [np.ones(shape) * (-3)] * len(keys))
    C = [np.zeros(shape)] * len(keys)
    D = [[np.ones(shape, ctx=ctx) * (-0.1) for ctx in contexts]] * len(keys)
    kv.push(keys, D)
    kv.pull(keys, out=C)
    print(f">>> push -0.1 from 3 cpus to 4 keys; C[0]\n{C[0]!r}", file=out)

    def update(key: Any, input: Any, stored: Any) -> None:
        print(f"update on key: {key}", file=out)
        stored += input * 0.01

    kv._set_updater(update)
    kv.push(3, mx.nd.ones(shape) * 5)
    kv.pull(3, out=A)
    print(f">>> updater stored += input * 0.01; push 5s\n{A.asnumpy()}", file=out)


def _optimizer(mx: Any, out: TextIO) -> None:
    print("\n== Server-side style optimizer (kv.set_optimizer) ==", file=out)
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.zeros((2, 2)))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    w = mx.nd.zeros((2, 2))
    for step in range(3):
        kv.push(3, mx.nd.ones((2, 2)))
        kv.pull(3, out=w)
        # the array as NumPy prints it (float32 shown as -0.1, not -0.10000000149011612)
        _show(out, f"step {step + 1}: weight", w)


SECTIONS: list[Callable[[Any, TextIO], None]] = [_basic, _string_keys, _notebook, _optimizer]


def run_tour(out: TextIO | None = None) -> None:
    """Run every section of the tour, printing to ``out`` (default stdout)."""
    import pskv as mx
    stream = out if out is not None else sys.stdout
    for section in SECTIONS:
        section(mx, stream)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pskv-tour`` and ``python -m pskv.tour``."""
    parser = argparse.ArgumentParser(
        prog="pskv-tour",
        description="Run the MXNet KVStore tutorial's examples on pskv and print the results.")
    parser.parse_args(argv)
    run_tour()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
