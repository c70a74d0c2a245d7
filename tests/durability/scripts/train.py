"""A small training job for the durability tests: deterministic gradients per rank and step.

Usage: train.py OUT STEPS [dist_sync|dist_async]. Rank 0 writes the final weights to
OUT/weights.npz; every worker writes how many pushes it made (OUT/pushes-<rank>.json).
dist_sync runs SGD with momentum (so optimizer states matter); dist_async runs SGD with
learning rate -1 (each push is added to the weights) and pushes ones to key "n" every
step, so "n" counts the pushes the servers applied. With DIE_WORKER and DIE_STEP set, that
worker SIGKILLs itself in the middle of that step on its first run (after pushing one key),
creating DIE_MARK-worker-<rank> first if DIE_MARK is set.
With TRAIN_PUSHPULL=1 each step is one ``pushpull`` per key from a gradient array that is
overwritten in place every step (as a framework's backward pass does), not push and pull.
With TRAIN_CLOBBER=1 each step pushes one gradient array per key (filled in place, so its
buffer is lent to the worker's push log, not copied) and overwrites it with garbage right
after the push, before the servers backed the push up (the log must copy it first).
With TRAIN_ONE_CALL=1 each step pushes every key in one call, then pulls them in one (a
server's rounds of a step then reach its backup as one batch). With TRAIN_TRACE=1 each
worker writes the value of "n" it pulled at each step to OUT/trace-<rank>-<restart>.txt
(to find the step where a faulted run leaves the calm one's values).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import pskv as mx

SHAPES = {"n": (2,), "w0": (300,), "w1": (40, 30), "w2": (7,)}


def _grad(step: int, rank: int, k: str) -> np.ndarray:
    """The gradient of key ``k`` at ``step`` on worker ``rank``."""
    if k == "n":
        return np.ones(SHAPES[k], np.float32)
    rng = np.random.default_rng([step, rank, len(k), ord(k[-1])])
    return rng.standard_normal(SHAPES[k]).astype(np.float32)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    store_type = sys.argv[3] if len(sys.argv) > 3 else "dist_sync"
    kv = mx.kv.create(store_type)
    keys = sorted(SHAPES)
    kv.init(keys, [mx.nd.ones(SHAPES[k]) for k in keys])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)
                     if store_type == "dist_sync" else mx.optimizer.SGD(learning_rate=-1.0))
    pushes = 0
    die = os.environ.get("PSKV_RESTART", "0") == "0" \
        and os.environ.get("DIE_WORKER") == str(kv.rank)
    pushpull = os.environ.get("TRAIN_PUSHPULL") == "1"
    one_call = os.environ.get("TRAIN_ONE_CALL") == "1"
    clobber = os.environ.get("TRAIN_CLOBBER") == "1"
    trace = None
    if os.environ.get("TRAIN_TRACE") == "1":
        trace = open(os.path.join(out, f"trace-{kv.rank}-{os.environ.get('PSKV_RESTART', '0')}.txt"),
                     "w", buffering=1)
    grads = {k: mx.nd.zeros(SHAPES[k]) for k in keys}
    weights = {k: mx.nd.zeros(SHAPES[k]) for k in keys}
    for step in range(steps):
        if one_call:
            kv.push(keys, [mx.nd.array(_grad(step, kv.rank, k)) for k in keys])
            pushes += len(keys)
            kv.pull(keys, out=[weights[k] for k in keys])
            time.sleep(0.01)
            continue
        for i, k in enumerate(keys):
            if die and step == int(os.environ["DIE_STEP"]) and i == 1:
                if "DIE_MARK" in os.environ:
                    with open(f"{os.environ['DIE_MARK']}-worker-{kv.rank}", "w"):
                        pass
                os.kill(os.getpid(), signal.SIGKILL)
            grad = _grad(step, kv.rank, k)
            if pushpull:
                grads[k][:] = grad           # the same buffer every step, as backward fills
                kv.pushpull(k, grads[k], out=weights[k])
            elif clobber:
                grads[k][:] = grad
                kv.push(k, grads[k])
                grads[k][:] = -1e6           # what a resent push must never carry
            else:
                kv.push(k, mx.nd.array(grad))
            pushes += 1
        if not pushpull:
            for k in keys:
                got = kv.pull(k)
                if trace is not None and k == "n":
                    trace.write(f"{step} {float(got.asnumpy()[0])!r}\n")
        time.sleep(0.01)
    kv.barrier()
    if kv.rank == 0:
        np.savez(os.path.join(out, "weights.npz"), **{k: kv.pull(k).asnumpy() for k in keys})
    with open(os.path.join(out, f"pushes-{kv.rank}.json"), "w") as f:
        json.dump({"pushes": pushes}, f)
    kv.close()


if __name__ == "__main__":
    main()
