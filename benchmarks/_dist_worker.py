"""One worker of ``bench_dist.py``: every dist_sync workload, under MXNet 1.9.1 or pskv.

The same file runs as a worker in MXNet's interpreter (``import mxnet as mx``) and in
pskv's (``import pskv as mx``), so both libraries run the same workload code and the same
timing loop. It must stay importable under NumPy 1.23 (MXNet's venv)::

    DMLC_ROLE=worker ... python _dist_worker.py worker LIB CONFIG_JSON OUT_PREFIX

writes ``OUT_PREFIX.<rank>.json``. Every worker runs the same workloads with the same
iteration counts (dist_sync keeps them in lockstep) and times its own loop; a barrier
starts each workload.

``python _dist_worker.py serve-empty`` (DMLC_ROLE=server or scheduler) runs a pskv server
whose handler does no arithmetic: pushes are acknowledged and counted for the sync round,
nothing is summed, copied or updated, and pulls return the stored value as it is (ps-lite's
EmptyHandler in ``tests/test_kv_app_benchmark.cc``). It times the transport and the
round bookkeeping alone; the values pulled are then meaningless (no checks).

Workloads (``config["workloads"]``, in this order; the keys of one never meet another's):

``small``     one key of ``shape`` float32: push, pull, wait; the time of each iteration
``dense``     one key of ``size`` float32 per size: push, pull, wait
``list``      ``keys`` keys of ``size`` float32 as one list call each: push, pull, waitall
``resnet``    ResNet-50 v1's 161 parameter tensors as one list call each (one "step")
``resnet_sgd``  the same after ``kv.set_optimizer(SGD(learning_rate=0.1, momentum=0.9))``
              on every worker: the servers run the update

Worker ``r`` pushes ``r + 1`` everywhere, so a pull after a sync round reads the sum over
workers (checked at the end of each workload; SGD against its closed form).
"""
from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
import traceback

import numpy as np


def resnet50_shapes():
    """The 161 trainable tensors of ResNet-50 v1 (gluon ``resnet50_v1``), 25,557,032 floats.

    conv1 7x7 + BN, then bottleneck stages of 3, 4, 6, 3 blocks (1x1, 3x3, 1x1 convs without
    bias, each with a BN's gamma and beta; the first block of a stage has a 1x1 downsample
    conv + BN), then the 1000-way fully connected layer (weight and bias). BN running
    statistics are not trained and not pushed.
    """
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for blocks, cout in zip((3, 4, 6, 3), (256, 512, 1024, 2048)):
        mid = cout // 4
        for b in range(blocks):
            shapes += [(mid, cin, 1, 1), (mid,), (mid,), (mid, mid, 3, 3), (mid,), (mid,),
                       (cout, mid, 1, 1), (cout,), (cout,)]
            if b == 0:
                shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
            cin = cout
    shapes += [(1000, 2048), (1000,)]
    return shapes


def _rss_mb():
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


def _barrier(kv):
    kv._barrier()


class Workload:
    """Keys set up on the servers; ``step()`` is one timed iteration."""

    nbytes = 0          # float32 bytes one push of one step carries (per worker)
    items = 1           # keys per step

    def __init__(self, mx, kv, rank):
        self.mx, self.kv, self.rank = mx, kv, rank
        self.value = float(rank + 1)
        self.steps = 0

    def _init(self, keys, shapes):
        mx = self.mx
        self.keys = keys
        self.kv.init(keys, [mx.nd.zeros(s) for s in shapes])
        self.vals = [mx.nd.ones(s) * self.value for s in shapes]
        self.outs = [mx.nd.zeros(s) for s in shapes]
        self.nbytes = int(sum(4 * int(np.prod(s)) for s in shapes))
        self.items = len(keys)

    def step(self):
        if len(self.keys) == 1:
            self.kv.push(self.keys[0], self.vals[0])
            self.kv.pull(self.keys[0], out=self.outs[0])
            self.outs[0].wait_to_read()
        else:
            self.kv.push(self.keys, self.vals)
            self.kv.pull(self.keys, out=self.outs)
            self.mx.nd.waitall()
        self.steps += 1

    def expected(self, total):
        """What every element of every out should read after ``self.steps`` rounds."""
        return total

    sgd = False

    def check(self, num_workers, lib):
        """"ok", "wrong: ..." or "skipped: why"."""
        if lib == "mxnet":
            # MXNet 1.9.1's KVStoreDist sends a single CPU value without a copy and pulls
            # into that same buffer (comm_buf_), so the pull overwrites the pushed array:
            # next round pushes the last result (3, 6, 12, ... with 2 workers)
            return "skipped: MXNet pulls into the pushed array"
        total = num_workers * (num_workers + 1) / 2.0
        want = self.expected(total)
        for o in (self.outs[0], self.outs[-1]):
            got = o.asnumpy().reshape(-1)[:4096]
            if not np.allclose(got, want, rtol=1e-3, atol=1e-3):
                return "wrong: expected %r, got %r" % (want, float(got[0]))
        return "ok"


class Dense(Workload):
    def __init__(self, mx, kv, rank, key, shape):
        super().__init__(mx, kv, rank)
        self._init([key], [tuple(shape)])


class KeyList(Workload):
    def __init__(self, mx, kv, rank, first, nkeys, size):
        super().__init__(mx, kv, rank)
        self._init(list(range(first, first + nkeys)), [(size,)] * nkeys)


class ResNet(Workload):
    def __init__(self, mx, kv, rank, first, sgd=False):
        super().__init__(mx, kv, rank)
        shapes = resnet50_shapes()
        self.sgd, self.w0 = sgd, 0.0
        self._init(list(range(first, first + len(shapes))), shapes)
        if sgd:
            kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))

    def expected(self, total):
        if not self.sgd:
            return total
        # mom = m*mom - lr*g; w += mom with a constant gradient g = total from w0
        lr, m = 0.1, 0.9
        return self.w0 - lr * total * sum((1 - m ** (j + 1)) / (1 - m)
                                          for j in range(self.steps))


def _time_reps(wl, reps, iters, per_iter=False):
    """``reps`` timed repeats of ``iters`` steps; seconds per step of each repeat."""
    out, each = [], []
    gc.disable()
    try:
        for _ in range(reps):
            if per_iter:
                for _ in range(iters):
                    t0 = time.perf_counter()
                    wl.step()
                    each.append(time.perf_counter() - t0)
                out.append(sum(each[-iters:]) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    wl.step()
                out.append((time.perf_counter() - t0) / iters)
    finally:
        gc.enable()
    return out, each


def _measure(lib, kv, name, wl, spec, num_workers, profile_dir, empty, per_iter=False):
    warm, reps, iters = int(spec["warmup"]), int(spec["reps"]), int(spec["iters"])
    for _ in range(warm):
        wl.step()
    _barrier(kv)
    prof = None
    if profile_dir:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    rep_s, each = _time_reps(wl, reps, iters, per_iter)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(profile_dir, "%s.rank%d.prof" % (name, wl.rank)))
    check = "skipped: empty handler" if empty else wl.check(num_workers, lib)
    res = {"reps": reps, "iters": iters, "warmup": warm, "seconds_per_step": rep_s,
           "bytes": wl.nbytes, "keys": wl.items, "wall_s": wall,
           "check": check}
    if per_iter:
        res["iteration_s"] = each
    _barrier(kv)
    return res


def run_worker(lib, config, out_prefix):
    if lib == "mxnet":
        import mxnet as mx
    elif lib == "pskv":
        import pskv as mx
    else:
        raise SystemExit("unknown library %r" % lib)
    t_start = time.perf_counter()
    kv = mx.kv.create("dist_sync")
    rank, nw = kv.rank, kv.num_workers
    info = {"lib": lib, "version": getattr(mx, "__version__", "?"), "rank": rank,
            "num_workers": nw, "numpy": np.__version__, "python": platform.python_version(),
            "pid": os.getpid(), "module": getattr(mx, "__name__", None),
            "results": {}, "errors": {},
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("MXNET_", "PSKV_", "OMP_", "DMLC_NUM", "DMLC_INTERFACE"))
                    and k != "PSKV_SECRET"},
            "connect_s": time.perf_counter() - t_start}
    work = config["workloads"]
    empty = bool(config.get("empty"))
    prof = config.get("profile_dir") if rank == 0 else None
    results = info["results"]

    def save():
        info["peak_rss_mb"] = _rss_mb()
        path = "%s.%d.json" % (out_prefix, rank)
        with open(path + ".tmp", "w") as f:
            json.dump(info, f, indent=1)
        os.replace(path + ".tmp", path)

    key = 0
    if "small" in work:
        spec = work["small"]
        wl = Dense(mx, kv, rank, key, spec["shape"])
        results["small"] = _measure(lib, kv, "small", wl, spec, nw, prof, empty,
                                    per_iter=True)
        save()
    key = 10
    for size, spec in work.get("dense", {}).items():
        wl = Dense(mx, kv, rank, key, (int(size),))
        key += 1
        results["dense_%s" % size] = _measure(lib, kv, "dense_%s" % size, wl, spec, nw, prof,
                                              empty)
        del wl
        save()
    if "list" in work:
        spec = work["list"]
        wl = KeyList(mx, kv, rank, 1000, int(spec["keys"]), int(spec["size"]))
        results["list"] = _measure(lib, kv, "list", wl, spec, nw, prof, empty)
        del wl
        save()
    if "resnet" in work:
        wl = ResNet(mx, kv, rank, 100000)
        results["resnet"] = _measure(lib, kv, "resnet", wl, work["resnet"], nw, prof, empty)
        del wl
        save()
    if "resnet_sgd" in work:    # last: the optimizer then applies to every key
        wl = ResNet(mx, kv, rank, 200000, sgd=True)
        results["resnet_sgd"] = _measure(lib, kv, "resnet_sgd", wl, work["resnet_sgd"], nw,
                                         prof, empty)
        del wl
        save()
    info["total_s"] = time.perf_counter() - t_start
    save()
    if hasattr(kv, "close"):
        kv.close()


def serve_empty():
    """A pskv scheduler, or a server whose handler moves bytes and does no arithmetic."""
    import logging

    import pskv  # noqa: F401  (the package, for its loggers)
    from pskv._ps.config import ClusterConfig, Role
    from pskv.kvstore.engine._core import Engine
    from pskv.kvstore.server._core import KVServer
    from pskv.server import run_node

    class EmptyEngine(Engine):
        """Sync rounds as usual; no sum, no copy, no update (the stored value stays)."""

        def accumulate(self, key, arrays, kind, first):
            pass

        def finish(self, key):
            pass

    logging.basicConfig(level=logging.WARNING)
    cfg = ClusterConfig.from_env()
    if cfg.role == Role.SERVER:
        return KVServer(cfg, engine_class=EmptyEngine).run()
    return run_node(cfg)


def main(argv):
    if len(argv) >= 1 and argv[0] == "serve-empty":
        return serve_empty()
    if len(argv) != 4 or argv[0] != "worker":
        sys.stderr.write(__doc__)
        return 2
    lib, config_path, out_prefix = argv[1:]
    with open(config_path) as f:
        config = json.load(f)
    try:
        run_worker(lib, config, out_prefix)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # a failed worker must not leave the other one (and the servers) waiting
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
