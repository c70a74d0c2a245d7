"""One side of ``bench_local.py``: runs the workloads under one library, driven over stdin.

The same file runs in the pskv interpreter (``--lib pskv`` or ``--lib numpy``) and in the
MXNet 1.9.1 interpreter (``--lib mxnet``), so both libraries run the same workload code
with the same timing method. It must stay importable under NumPy 1.23 (MXNet's venv) and
must not import pskv unless asked to.

Protocol: one JSON request per stdin line, one JSON reply per stdout line that starts with
``REPLY_PREFIX`` (other stdout lines, e.g. a library's chatter, are ignored by the driver).
Requests::

    {"op": "info"}                                   -> versions and settings
    {"op": "setup", "name": N, "case": {...}}        -> builds state N, warms up, picks iters
    {"op": "run", "name": N, "reps": R}              -> R timed repeats: seconds per iteration
    {"op": "teardown", "name": N}                    -> checks the result, frees state N
    {"op": "quit"}

Cases (``case["kind"]``):

``tiny``
    one key of ``shape``; push one value, pull into one out.
``list``
    ``keys`` keys of ``size`` float32 each; ``kv.push(keys, vals)`` and
    ``kv.pull(keys, out=outs)`` as one list call each.
``big``
    one key of ``size`` float32; push ``devices`` values (one per ``cpu(i)``), pull into
    ``devices`` outs; ``mode`` is ``assign`` (no updater), ``updater``
    (``stored += input * 2``) or ``sgd`` (``SGD(learning_rate=0.1, momentum=0.9)``).
``np_big``
    plain NumPy reduce-and-broadcast of the ``big`` shapes on ``threads`` threads (the
    memory-bandwidth reference; ``--lib numpy`` only).

One iteration is push then pull then a wait for the outs (MXNet runs asynchronously; the
wait is a no-op in pskv), so every figure includes the work itself.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

REPLY_PREFIX = "@@bench_local@@ "


def _reply(obj):
    sys.stdout.write(REPLY_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _rss_mb():
    """Peak resident set size of this process, in MiB."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


def update_times_two(key, input, stored):
    """The benchmark's custom updater, as MXNet users write it."""
    stored += input * 2


# ---- workloads ------------------------------------------------------------------------
class Tiny:
    def __init__(self, mx, case):
        shape = tuple(case["shape"])
        self.mx = mx
        self.kv = mx.kv.create("local")
        self.kv.init(0, mx.nd.zeros(shape))
        self.val = mx.nd.ones(shape)
        self.out = mx.nd.zeros(shape)

    def step(self):
        self.kv.push(0, self.val)
        self.kv.pull(0, out=self.out)
        self.out.wait_to_read()

    def check(self):
        return bool(np.all(self.out.asnumpy() == 1.0))

    def close(self):
        _close(self.kv)


class KeyList:
    def __init__(self, mx, case):
        nkeys, size = int(case["keys"]), int(case["size"])
        self.mx = mx
        self.kv = mx.kv.create("local")
        self.keys = list(range(nkeys))
        self.kv.init(self.keys, [mx.nd.zeros((size,)) for _ in self.keys])
        self.vals = [mx.nd.ones((size,)) for _ in self.keys]
        self.outs = [mx.nd.zeros((size,)) for _ in self.keys]
        self.items = nkeys  # a "key" is one key pushed and pulled

    def step(self):
        self.kv.push(self.keys, self.vals)
        self.kv.pull(self.keys, out=self.outs)
        self.mx.nd.waitall()

    def check(self):
        return bool(all(np.all(o.asnumpy() == 1.0) for o in (self.outs[0], self.outs[-1])))

    def close(self):
        _close(self.kv)


class Big:
    def __init__(self, mx, case):
        size, devices, mode = int(case["size"]), int(case["devices"]), case["mode"]
        self.mx, self.mode, self.devices = mx, mode, devices
        self.kv = mx.kv.create("local")
        self.kv.init(0, mx.nd.zeros((size,)))
        if mode == "updater":
            self.kv._set_updater(update_times_two)
        elif mode == "sgd":
            self.kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        elif mode != "assign":
            raise ValueError("unknown mode %r" % mode)
        self.vals = [mx.nd.ones((size,), ctx=mx.cpu(i)) for i in range(devices)]
        self.outs = [mx.nd.zeros((size,), ctx=mx.cpu(i)) for i in range(devices)]
        self.steps = 0

    def step(self):
        self.kv.push(0, self.vals)
        self.kv.pull(0, out=self.outs)
        self.mx.nd.waitall()
        self.steps += 1

    def check(self):
        first, last = self.outs[0].asnumpy(), self.outs[-1].asnumpy()
        if not np.array_equal(first[:1000], last[:1000]):
            return False
        if self.mode == "assign":
            return bool(np.all(first == self.devices))
        if self.mode == "updater":
            return bool(np.allclose(first[:1000], 2.0 * self.devices * self.steps))
        # SGD with momentum on a constant gradient g: w_t = -lr * g * sum_{j<t} S_j,
        # S_j = sum_{i<=j} m^i (MXNet's mom = m*mom - lr*g; w += mom)
        lr, m, g = 0.1, 0.9, float(self.devices)
        expect = -lr * g * sum((1 - m ** (j + 1)) / (1 - m) for j in range(self.steps))
        return bool(np.allclose(first[:1000], expect, rtol=1e-3, atol=1e-3))

    def close(self):
        _close(self.kv)


class NumpyBig:
    """Reduce-and-broadcast in plain NumPy: ``s = a0 + a1 + ...``; ``out_i[:] = s``.

    With ``threads`` > 1 the flat range is split into equal chunks, one per thread, and each
    thread reduces and broadcasts its own chunk (NumPy releases the GIL), one join per step.
    """

    def __init__(self, mx, case):
        size, devices, threads = int(case["size"]), int(case["devices"]), int(case["threads"])
        self.devices = devices
        self.vals = [np.ones(size, np.float32) for _ in range(devices)]
        self.outs = [np.zeros(size, np.float32) for _ in range(devices)]
        self.stored = np.zeros(size, np.float32)
        step = -(-size // threads)
        step += (-step) % 64
        self.chunks = [(a, min(a + step, size)) for a in range(0, size, step)]
        self.pool = ThreadPoolExecutor(threads) if len(self.chunks) > 1 else None

    def _chunk(self, a, b):
        s, vals = self.stored[a:b], self.vals
        if len(vals) == 1:
            np.copyto(s, vals[0][a:b])
        else:
            np.add(vals[0][a:b], vals[1][a:b], out=s)
            for v in vals[2:]:
                np.add(s, v[a:b], out=s)
        for o in self.outs:
            np.copyto(o[a:b], s)

    def step(self):
        if self.pool is None:
            self._chunk(0, self.stored.size)
            return
        futs = [self.pool.submit(self._chunk, a, b) for a, b in self.chunks[1:]]
        self._chunk(*self.chunks[0])
        for f in futs:
            f.result()

    def check(self):
        return bool(np.all(self.outs[-1] == self.devices))

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _close(kv):
    close = getattr(kv, "close", None)  # pskv stores hold a thread pool; MXNet's have none
    if close is not None:
        close()


KINDS = {"tiny": Tiny, "list": KeyList, "big": Big, "np_big": NumpyBig}


# ---- timing -------------------------------------------------------------------------
def _time(step, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def _setup(mx, states, name, case, budget):
    states.pop(name, None)
    gc.collect()
    state = KINDS[case["kind"]](mx, case)
    states[name] = state
    state.step()  # first touch: allocation, pools, lazily built kernels
    # warm up for about a third of a repeat's budget, then size a repeat to ``budget``
    per = _time(state.step, 1)
    warm = max(3, min(1000, int(budget / 3 / max(per, 1e-7))))
    per = _time(state.step, warm)
    iters = max(1, min(int(case.get("max_iters", 100000)), int(round(budget / max(per, 1e-7)))))
    state.iters = iters
    return {"iters": iters, "warm_s_per_iter": per}


def _handle(mx, states, req, budget):
    op = req["op"]
    if op == "setup":
        return _setup(mx, states, req["name"], req["case"], float(req.get("budget", budget)))
    if op == "run":
        state = states[req["name"]]
        gc_was = gc.isenabled()
        gc.disable()
        try:
            times = [_time(state.step, state.iters) for _ in range(int(req["reps"]))]
        finally:
            if gc_was:
                gc.enable()
        return {"times": times}
    if op == "teardown":
        state = states.pop(req["name"])
        ok = state.check()
        state.close()
        del state
        gc.collect()
        return {"check": ok, "peak_rss_mib": _rss_mb()}
    raise ValueError("unknown op %r" % op)


def _info(lib, mx):
    info = {"lib": lib, "python": platform.python_version(), "numpy": np.__version__,
            "pid": os.getpid(),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("OMP_", "MXNET_", "PSKV_REDUCE", "KMP_", "OPENBLAS_"))}}
    if mx is not None:
        info["version"] = getattr(mx, "__version__", None)
    if lib == "pskv":
        from pskv.kvstore._reduce import Reducer  # the pool size a local store gets
        threads = int(os.environ.get("PSKV_REDUCE_THREADS", "0")) or None
        info["reduce_threads"] = Reducer(threads).threads
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", choices=["pskv", "mxnet", "numpy"], required=True)
    parser.add_argument("--budget", type=float, default=0.2,
                        help="seconds per timed repeat (default 0.2)")
    args = parser.parse_args(argv)
    mx = None
    if args.lib == "mxnet":
        import warnings
        warnings.filterwarnings("ignore")
        import mxnet as mx
    elif args.lib == "pskv":
        import pskv as mx
    states = {}
    _reply({"ok": True, "info": _info(args.lib, mx)})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            _reply({"ok": True, "result": _handle(mx, states, req, args.budget)})
        except Exception as err:  # report any failure of one case; the driver goes on
            states.pop(req.get("name"), None)
            gc.collect()
            _reply({"ok": False, "error": "%s: %s" % (type(err).__name__, err),
                    "traceback": traceback.format_exc()[-3000:]})
    for state in states.values():
        state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
