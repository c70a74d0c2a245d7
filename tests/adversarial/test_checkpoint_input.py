"""Checkpoints are untrusted input: a damaged or hostile checkpoint is refused, bounded.

Each load runs in a child process with a memory limit (``RLIMIT_AS``) and a timeout, so a
loader that hangs (a manifest naming 10**9 shards, a FIFO in place of a file) or inflates
(a deflate bomb, a key of 10**12 elements) fails the test instead of the machine. Every
refusal must be a CheckpointError, quickly. A worker's checkpoint path is confined to
PSKV_CHECKPOINT_DIR when the job sets it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command
from pskv._ps.ops import Op, command
from pskv.errors import CheckpointError
from pskv.kvstore._snapshot import FORMAT, MANIFEST, shard_name

from .conftest import assert_unharmed, push_and_pull

SRC = str(Path(__file__).resolve().parents[2] / "src")

_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
sys.path.insert(0, {src!r})
import pskv as mx
kv = mx.kv.create("local")
kv.init("w", mx.nd.ones((3,)))
t0 = time.monotonic()
try:
    if {mode!r} == "states":
        kv.set_optimizer(mx.optimizer.SGD(momentum=0.9))
        kv.load_optimizer_states({path!r})
    elif {mode!r} == "restart":
        from pskv.kvstore.durable._snapshots import load_shard
        from pskv.kvstore.engine._core import Engine
        load_shard(Engine(), {path!r}, 0, 1)
    else:
        kv.load_checkpoint({path!r})
    out = {{"error": None}}
except BaseException as err:
    out = {{"error": type(err).__name__, "msg": str(err)[:300]}}
out["seconds"] = round(time.monotonic() - t0, 2)
print(json.dumps(out))
"""


def _load(path: Path, mode: str = "checkpoint", timeout: float = 20.0) -> dict[str, Any]:
    """Load ``path`` in a child (1.5 GiB of address space): a checkpoint with
    ``load_checkpoint`` (``mode='checkpoint'``) or as a restarted server's shard
    (``'restart'``), or optimizer states (``'states'``); what it raised."""
    script = _CHILD.format(limit=1536 << 20, src=SRC, path=str(path), mode=mode)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "hung", "seconds": timeout}
    lines = out.stdout.strip().splitlines()
    if not lines:
        return {"error": f"died ({out.returncode})", "msg": out.stderr[-300:]}
    got: dict[str, Any] = json.loads(lines[-1])
    return got


def _good(tmp: Path) -> Path:
    """A checkpoint of key 'w' (3 float32) written by a local store."""
    kv = mx.kv.create("local")
    kv.init("w", mx.nd.ones((3,)))
    kv.save_checkpoint(str(tmp / "good"))
    return tmp / "good"


def _manifest(path: Path, **changes: Any) -> None:
    body = {"format": FORMAT, "version": 1, "num_shards": 1, "round": None,
            "store_type": "local", **changes}
    (path / MANIFEST).write_text(json.dumps(body))


def _shard(path: Path, entries: list[Any], arrays: dict[str, np.ndarray]) -> None:
    meta = {"format": FORMAT, "version": 1, "entries": entries, "optimizer": None,
            "compression": None}
    named = {k: v for k, v in arrays.items()}
    named["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(str(path / shard_name(0)), allow_pickle=False, **named)


def _entry(**changes: Any) -> dict[str, Any]:
    return {"key": "w", "id": "w", "shape": [3], "dtype": "float32", "stype": "default",
            "start": 0, "stop": 3, "round": 0, "applied": [], **changes}


def _bomb(path: Path, inflated: int) -> None:
    """A shard (or, ``path`` a file, an archive) whose ``__meta__`` member deflates from a
    few MB to ``inflated`` bytes."""
    from numpy.lib import format as npy
    tail = json.dumps({"format": FORMAT, "version": 1, "entries": [_entry()],
                       "optimizer": None, "compression": None}).encode()
    target = path / shard_name(0) if path.is_dir() else path
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("w0.npy", "w") as m:
            npy.write_array(m, np.ones(3, np.float32))
        with zf.open("__meta__.npy", "w", force_zip64=True) as m:
            npy.write_array_header_1_0(m, {"descr": "|u1", "fortran_order": False,
                                           "shape": (inflated,)})
            chunk = b" " * (16 << 20)
            left = inflated - len(tail)
            while left > 0:
                m.write(chunk[:left])
                left -= len(chunk)
            m.write(tail)


@pytest.mark.timeout(180)
def test_hostile_checkpoints_are_refused_quickly_and_bounded(tmp_path: Path) -> None:
    cases: dict[str, Path] = {}

    def case(name: str) -> Path:
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        cases[name] = d
        return d

    good = _good(tmp_path)
    shard = (good / shard_name(0)).read_bytes()
    _manifest(case("a billion shards"), num_shards=10 ** 9)
    d = case("manifest of 1 MiB")
    (d / MANIFEST).write_text(" " * (1 << 20) + json.dumps({
        "format": FORMAT, "version": 1, "num_shards": 1, "round": None}))
    (d / shard_name(0)).write_bytes(shard)
    d = case("fifo shard")
    _manifest(d)
    os.mkfifo(d / shard_name(0))
    d = case("fifo manifest")
    os.mkfifo(d / MANIFEST)
    d = case("deflate bomb")
    _manifest(d)
    _bomb(d, 1 << 30)
    ones = {"w0": np.ones(3, np.float32)}
    for name, entry, arrays in [
            ("shape not a list", _entry(shape="x"), ones),
            ("start past stop", _entry(start=3, stop=1), ones),
            ("dtype object", _entry(dtype="object"), ones),
            ("part of another shape", _entry(), {"w0": np.ones(5, np.float32)}),
            ("part missing", _entry(), {}),
            ("no key", {"shape": [3]}, ones),
            ("round not an int", _entry(round="7"), ones),
            ("10**12 elements", _entry(shape=[10 ** 12], stop=10 ** 12), ones)]:
        d = case(name)
        _manifest(d)
        _shard(d, [entry], arrays)
    d = case("bad round in manifest")
    _manifest(d, round=[1])
    (d / shard_name(0)).write_bytes(shard)

    got = {name: _load(path) for name, path in cases.items()}
    got["restart: 10**12 elements"] = _load(cases["10**12 elements"], "restart")
    got["restart: deflate bomb"] = _load(cases["deflate bomb"], "restart")
    os.mkfifo(tmp_path / "states-fifo")
    got["states: fifo"] = _load(tmp_path / "states-fifo", "states")
    _bomb(tmp_path / "states-bomb", 1 << 30)
    got["states: deflate bomb"] = _load(tmp_path / "states-bomb", "states")
    print(json.dumps({name: g.get("seconds") for name, g in got.items()}))
    for name, g in got.items():
        want = {"states: fifo": "ConfigError", "states: deflate bomb": "OptimizerStateError"}
        assert g["error"] == want.get(name, "CheckpointError"), (name, g)
    assert _load(good)["error"] is None


@pytest.mark.timeout(90)
def test_checkpoint_paths_are_confined_to_the_checkpoint_dir(thread_cluster: Any,
                                                             tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    (root / "link").symlink_to(tmp_path)
    billion = root / "billion"
    billion.mkdir()
    _manifest(billion, num_shards=10 ** 9)
    cluster = thread_cluster(2, 2, checkpoint_dir=str(root))
    got: dict[str, Any] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        for name, path in (("outside", outside), ("through a link", root / "link" / "x")):
            try:
                kv.save_checkpoint(str(path))
            except CheckpointError as err:
                got[f"{name} {kv.rank}"] = err
        kv.save_checkpoint(str(root / "mine"))      # under it: written
        if kv.rank == 0:
            for name, op, path in (("raw save", Op.CHECKPOINT, outside),
                                   ("raw load", Op.RESTORE, outside / "x"),
                                   ("raw billion", Op.RESTORE, billion)):
                ts = kv._kv.request(0, Command.COMMAND, body=command(op, path=str(path)))
                try:
                    kv._kv.wait(ts, timeout=10)
                except mx.KVStoreError as err:
                    got[name] = err
            go.set()
        else:
            go.wait(30)
        kv.barrier()
        return push_and_pull(kv)

    res = cluster.run(fn, timeout=60)
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    for rank in (0, 1):
        for name in ("outside", "through a link"):
            err = got[f"{name} {rank}"]
            assert "PSKV_CHECKPOINT_DIR" in str(err), err
    for name in ("raw save", "raw load"):
        assert isinstance(got[name], CheckpointError), got.get(name)
        assert "PSKV_CHECKPOINT_DIR" in str(got[name]) and "reported by server 0" in \
            str(got[name]), got[name]
    assert isinstance(got["raw billion"], CheckpointError), got.get("raw billion")
    assert not outside.exists()
    assert not (tmp_path / "x").exists()
    assert (root / "mine" / MANIFEST).exists()
