"""Run MXNet 1.9.1's own KVStore tests, unchanged, against pskv.

The test files are read from an MXNet source checkout (``PSKV_MXNET_SRC`` or ``--src``,
tag 1.9.1) and copied into a temporary directory, next to an ``mxnet`` package that
re-exports pskv (``import mxnet as mx`` gets pskv) and small stand-ins for the test
harness modules they import (``common`` of tests/python/unittest, which needs nose).
Nothing of MXNet's is kept: the directory is deleted after each run.

    python tests/mxnet/run_mxnet_suite.py --src ~/src/mxnet          # every case
    python tests/mxnet/run_mxnet_suite.py --src ~/src/mxnet -k dist   # names containing 'dist'

Each case prints PASS or FAIL and the tail of its output; the exit status is the number
of failed cases (capped at 100). ``tests/mxnet/test_mxnet_suite.py`` runs the same cases
under pytest. See docs/mxnet-tests.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ENV_MXNET_SRC = "PSKV_MXNET_SRC"
_ROOT = Path(__file__).resolve().parents[2]

# the alias package: MXNet's module names, pskv's objects
_ALIAS_INIT = '''
"""An alias package: ``import mxnet`` gives pskv (written by run_mxnet_suite.py)."""
import sys as _sys

import pskv as _pskv
from pskv import *  # noqa: F401,F403
from pskv import context, kv, kvstore, lr_scheduler, nd, np, optimizer, random  # noqa: F401

from . import base, test_utils  # noqa: F401
from .base import MXNetError  # noqa: F401

ndarray = nd
numpy = np
__version__ = "1.9.1+pskv-" + _pskv.__version__
for _name, _mod in {"ndarray": nd, "ndarray.sparse": nd.sparse, "nd.sparse": nd.sparse,
                    "numpy": np, "kvstore": kvstore, "kv": kv, "optimizer": optimizer,
                    "random": random, "context": context, "nd": nd,
                    "lr_scheduler": lr_scheduler}.items():
    _sys.modules[__name__ + "." + _name] = _mod
'''

_ALIAS_BASE = '''
"""``mxnet.base``: MXNetError is pskv's KVStoreError, the base of every error pskv raises."""
from pskv.errors import KVStoreError as MXNetError  # noqa: F401


def py_str(x):
    return x.decode("utf-8") if isinstance(x, bytes) else x
'''

_ALIAS_TEST_UTILS = '''
from pskv.test_utils import *  # noqa: F401,F403
'''

# stand-in for tests/python/unittest/common.py (which imports nose and MXNet's models)
_COMMON = '''
"""The names test_kvstore.py imports from MXNet's tests/python/unittest/common.py."""
import functools
import random

import mxnet as mx
import numpy as np


def setup_module():
    pass


def teardown():
    mx.nd.waitall()


def assertRaises(expected_exception, func, *args, **kwargs):
    try:
        func(*args, **kwargs)
    except expected_exception:
        return
    raise AssertionError("%s did not raise %s" % (func.__name__, expected_exception.__name__))


def with_seed(seed=None):
    def wrap(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            s = seed if seed is not None else np.random.randint(0, 2**31 - 1)
            state = np.random.get_state()
            np.random.seed(s)
            mx.random.seed(s)
            random.seed(s)
            try:
                return test(*args, **kwargs)
            finally:
                np.random.set_state(state)
        return run
    return wrap
'''

_PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\n"


@dataclasses.dataclass(frozen=True)
class Case:
    """One MXNet test run: a file (relative to the MXNet checkout) and how to run it."""

    name: str
    path: str
    args: tuple[str, ...] = ()
    workers: int = 0           # 0: run alone; else under pskv-launch with this many workers
    servers: int = 1
    pytest: bool = False       # a pytest module rather than a script
    needs: tuple[str, ...] = ()  # other files of the same folder it imports
    timeout: float = 300.0


_N = "tests/nightly/"
CASES: tuple[Case, ...] = (
    Case("unittest_test_kvstore", "tests/python/unittest/test_kvstore.py", pytest=True),
    Case("nightly_test_kvstore", _N + "test_kvstore.py", timeout=600.0),
    Case("dist_sync_default", _N + "dist_sync_kvstore.py", ("--nrepeat=2",), workers=2,
         needs=("test_kvstore.py",)),
    Case("dist_sync_default_no_multiprecision", _N + "dist_sync_kvstore.py",
         ("--nrepeat=2", "--no-multiprecision"), workers=2, needs=("test_kvstore.py",)),
    Case("dist_sync_compressed", _N + "dist_sync_kvstore.py",
         ("--type=compressed_cpu", "--nrepeat=2"), workers=2, needs=("test_kvstore.py",)),
    Case("dist_sync_compressed_no_multiprecision", _N + "dist_sync_kvstore.py",
         ("--type=compressed_cpu", "--nrepeat=2", "--no-multiprecision"), workers=2,
         needs=("test_kvstore.py",)),
    Case("dist_sync_init_gpu", _N + "dist_sync_kvstore.py", ("--type=init_gpu",),
         workers=2, needs=("test_kvstore.py",)),
    Case("dist_sync_invalid", _N + "dist_sync_kvstore.py", ("--type=invalid_cpu",),
         workers=2, needs=("test_kvstore.py",)),
    Case("dist_sync_gluon_type", _N + "dist_sync_kvstore.py", ("--type=gluon_type_cpu",),
         workers=2, needs=("test_kvstore.py",)),
    Case("dist_sync_gluon_step", _N + "dist_sync_kvstore.py", ("--type=gluon_step_cpu",),
         workers=2, needs=("test_kvstore.py",)),
    Case("dist_sync_gluon_sparse_step", _N + "dist_sync_kvstore.py",
         ("--type=gluon_sparse_step_cpu",), workers=2, needs=("test_kvstore.py",)),
    Case("dist_device_sync", _N + "dist_device_sync_kvstore.py", workers=2),
    Case("dist_device_sync_custom", _N + "dist_device_sync_kvstore_custom.py", workers=2),
    Case("dist_async", _N + "dist_async_kvstore.py", workers=2),
)


@dataclasses.dataclass(frozen=True)
class Result:
    """How one case ended: ``rc`` 0 is a pass; ``output`` is stdout and stderr together."""

    case: Case
    rc: int
    output: str

    @property
    def passed(self) -> bool:
        return self.rc == 0


def missing_files(src: Path, case: Case) -> list[str]:
    """The files of ``case`` that the checkout ``src`` lacks."""
    folder = Path(case.path).parent
    wanted = [Path(case.path)] + [folder / n for n in case.needs]
    return [str(p) for p in wanted if not (src / p).is_file()]


def write_alias(where: Path) -> None:
    """Write the ``mxnet`` alias package and the harness stand-ins into ``where``."""
    pkg = where / "mxnet"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(_ALIAS_INIT))
    (pkg / "base.py").write_text(textwrap.dedent(_ALIAS_BASE))
    (pkg / "test_utils.py").write_text(_ALIAS_TEST_UTILS)
    (where / "common.py").write_text(textwrap.dedent(_COMMON))
    (where / "pytest.ini").write_text(_PYTEST_INI)


def _command(case: Case, script: Path) -> list[str]:
    if case.pytest:
        run = [sys.executable, "-m", "pytest", "-q", "-c", str(script.parent / "pytest.ini"),
               "--rootdir", str(script.parent), str(script)]
    else:
        run = [sys.executable, str(script), *case.args]
    if not case.workers:
        return run
    return [sys.executable, "-m", "pskv.launch", "-n", str(case.workers), "-s",
            str(case.servers), "--launcher", "local", "--timeout", str(int(case.timeout)),
            *run]


def run_case(case: Case, src: Path, timeout: float | None = None) -> Result:
    """Run one case against pskv in a fresh temporary directory; never raises for a failure."""
    with tempfile.TemporaryDirectory(prefix="pskv-mxnet-") as tmp:
        work = Path(tmp)
        write_alias(work)
        folder = Path(case.path).parent
        for name in (Path(case.path).name, *case.needs):
            shutil.copyfile(src / folder / name, work / name)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DMLC_", "MXNET_", "PSKV_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(work), str(_ROOT / "src")])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(_command(case, work / Path(case.path).name), cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout or case.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            return Result(case, 124, (out or "") + f"\n[timed out after {case.timeout} s]")
        finally:
            if proc.poll() is None:  # pragma: no cover - interrupted
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        return Result(case, proc.returncode, out or "")


def main(argv: list[str] | None = None) -> int:
    """Run the cases whose names contain ``-k``; print PASS/FAIL and failing output tails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=os.environ.get(ENV_MXNET_SRC),
                        help=f"MXNet 1.9.1 source checkout (default: ${ENV_MXNET_SRC})")
    parser.add_argument("-k", default="", help="run the cases whose names contain this")
    parser.add_argument("--tail", type=int, default=2000, help="characters of output shown")
    opts = parser.parse_args(argv)
    if not opts.src:
        parser.error(f"no MXNet checkout: pass --src or set {ENV_MXNET_SRC}")
    src = Path(opts.src)
    failed = 0
    for case in CASES:
        if opts.k not in case.name:
            continue
        missing = missing_files(src, case)
        if missing:
            print(f"SKIP {case.name}: {src} has no {', '.join(missing)}", flush=True)
            continue
        result = run_case(case, src)
        print(f"{'PASS' if result.passed else 'FAIL'} {case.name} (rc={result.rc})", flush=True)
        if not result.passed:
            failed += 1
            print(textwrap.indent(result.output[-opts.tail:], "    "), flush=True)
    return min(failed, 100)


if __name__ == "__main__":
    sys.exit(main())
