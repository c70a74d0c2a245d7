"""Another process of the same user against the collective path's shared memory (issue #34
item 7): it finds the workers' segments under ``/proc/<pid>/fd`` and tries to rewrite them.
Every segment is sealed against writes but its owner's mapping (``F_SEAL_FUTURE_WRITE``),
so each attempt fails with EPERM and the workers' sums stay right; before, the writes
went through and a pull returned the writer's bytes, unnoticed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pskv._ps import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="no sealed memfds here")

#: the same-user writer: every pskv segment of process argv[1], rewritten with 0xff bytes
#: through write() and through a writable shared mapping; what each attempt got
WRITER = r"""
import errno, json, mmap, os, sys
pid = sys.argv[1]
got = []
for name in os.listdir(f"/proc/{pid}/fd"):
    try:
        if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:pskv-"):
            continue
        fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDWR)
    except OSError:
        continue
    size = os.fstat(fd).st_size
    for how in ("write", "mmap"):
        try:
            if how == "write":
                os.pwrite(fd, b"\xff" * size, 0)
            else:
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                mm[:] = b"\xff" * size
                mm.close()
            got.append([how, "wrote"])
        except OSError as err:
            got.append([how, errno.errorcode.get(err.errno, str(err.errno))])
    os.close(fd)
print(json.dumps(got))
"""


def test_a_same_user_writer_cannot_rewrite_the_segments(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(1000, np.float32))
        kv.push("w", np.ones(1000, np.float32))
        first = np.array(kv.pull("w"))           # a round through the segments
        kv._barrier()
        attempts = None
        if kv.rank == 0:        # the workers are threads of this process: its segments
            done = subprocess.run([sys.executable, "-c", WRITER, str(os.getpid())],
                                  capture_output=True, text=True, timeout=60, check=True)
            attempts = json.loads(done.stdout)
        kv._barrier()
        again = np.array(kv.pull("w"))           # the sums read from the sum slots again
        kv.push("w", np.ones(1000, np.float32))
        after = np.array(kv.pull("w"))           # and a round after
        coll = kv._peers.path
        return attempts, first, again, after, sorted(coll._shm) if coll is not None else []

    res = run_threads(fn, num_workers=2, collective_bytes=8)
    for value in res.values():
        if isinstance(value, BaseException):
            raise value
    attempts = res[0][0]
    assert res[0][4] == [1] and res[1][4] == [0]          # linked through shared memory
    assert attempts, "the writer found no segment"
    assert all(outcome == "EPERM" for _how, outcome in attempts), attempts
    for r in (0, 1):
        _, first, again, after, _ = res[r]
        assert np.array_equal(first, np.full(1000, 2, np.float32))
        assert np.array_equal(again, first), f"worker {r} pulled what the writer wrote"
        assert np.array_equal(after, np.full(1000, 2, np.float32))
