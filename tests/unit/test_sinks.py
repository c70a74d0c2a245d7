"""Sinks (pskv.sinks, rules F1-F8): what a FileSink writes replays to the table bit for bit,
at any moment, through rotations, restarts and resets of single shards; damaged files are
refused; the command's arguments. No sockets (the Redis sink: tests/dist)."""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest

import pskv as mx
from pskv.errors import CheckpointError, ConfigError, ShapeMismatchError
from pskv.kvstore._subscription import Subscription
from pskv.optimizer import AdaGrad
from pskv.sinks import FileSink, main, replay, run_sink
from pskv.sinks._run import _key, make_sink
from pskv.sinks._segments import MANIFEST
from pskv.table import TTL, Capacity, DynamicTable, TableSpec, Uniform
from pskv.table._stream import TombLog, read_changes


def _spec(dtype: str = "float32", **kw):
    base = dict(dim=4, init=Uniform(-0.1, 0.1), seed=5, dtype=dtype,
                eviction=(Capacity(max_rows=60, policy="lfu"), TTL(steps=6)))
    base.update(kw)
    return TableSpec(**base)


def _want(table: DynamicTable, raw: bool) -> tuple[np.ndarray, bytes]:
    """The table's IDs (sorted) and their rows' bytes, as the stream gives them."""
    ids = table.ids()
    rows = table._values[table._index.find(ids)] if raw else \
        table.lookup(ids, train=False)[0].astype(np.float32)
    return ids, np.ascontiguousarray(rows).tobytes()


def _same(directory: Path, tables: list[DynamicTable], raw: bool) -> None:
    mirror = replay(directory)
    ids, rows = mirror.table()
    want = [_want(t, raw) for t in tables]
    all_ids = np.concatenate([w[0] for w in want])
    order = np.argsort(all_ids, kind="stable")
    assert np.array_equal(ids, all_ids[order])
    dim = tables[0].spec.dim
    itemsize = rows.dtype.itemsize
    width = dim * itemsize
    blob = b"".join(w[1] for w in want)
    want_rows = b"".join(blob[i * width:(i + 1) * width] for i in order.tolist())
    assert rows.tobytes() == want_rows
    assert mirror.since() == {s: (t.lineage, t.version) for s, t in enumerate(tables)}


class Shards:
    """A source of several shards (one DynamicTable each), as a dist store's servers are:
    ``subscribe`` gives the Subscription class every store gives."""

    def __init__(self, n: int, spec: TableSpec, key: str = "emb") -> None:
        self.key, self.spec = key, spec
        self.tables = [DynamicTable(spec, name=key) for _ in range(n)]

    def subscribe(self, key, since=None, *, raw=False, max_rows=7):
        def fetch(s, since_v, lineage, cursor, upto):
            return read_changes(self.tables[s], since_v, lineage, cursor=cursor, upto=upto,
                                max_rows=max_rows, raw=raw, key=key,
                                shard=(s, len(self.tables)))
        return Subscription(key, fetch, len(self.tables), since)

    def reload(self, s: int) -> None:
        """Shard ``s`` reloaded from its own state: a new lineage (its history forked)."""
        arrays, meta = self.tables[s].state()
        self.tables[s] = DynamicTable.from_state(self.spec, arrays, meta, name=self.key)


def _table(kv, key="emb") -> DynamicTable:
    return kv._tables.get(key, "test")


def _train(kv, rng, steps: int, key="emb") -> None:
    for _ in range(steps):
        ids = rng.integers(0, 200, 30)
        kv.lookup(key, ids)
        kv.push(key, (ids, rng.standard_normal((30, 4)).astype(np.float32)))


@pytest.mark.parametrize("dtype,raw", [("float32", False), ("bfloat16", True),
                                       ("bfloat16", False), ("float16", True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_replay_equals_the_table_bit_for_bit_at_random_moments(tmp_path, dtype, raw, seed):
    rng = np.random.default_rng(seed)
    kv = mx.kv.create("local")
    kv.init("emb", _spec(dtype))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    sink = FileSink(tmp_path, "emb", raw=raw, max_deltas=int(rng.integers(2, 6)), fsync=False)
    sub = kv.subscribe("emb", since=sink.position(), raw=raw, max_rows=int(rng.integers(5, 50)))
    fulls = 0
    for _ in range(25):
        _train(kv, rng, int(rng.integers(0, 6)))
        name = sink.write(sub.poll())
        fulls += name is not None and name.endswith("-full.npz")
        _same(tmp_path, [_table(kv)], raw)
        # superseded segments are gone: the directory holds what the manifest names (F5)
        assert sorted(p.name for p in tmp_path.glob("seg-*.npz")) == sink.segments
        assert sink.segments[0].endswith("-full.npz")
        assert all(s.endswith("-delta.npz") for s in sink.segments[1:])
    sink.close()
    assert fulls >= 2                                       # it did rotate
    assert _table(kv).stats()["evictions"] > 0              # removals did travel
    man = json.loads((tmp_path / MANIFEST).read_text())
    assert man["dtype"] == (dtype if raw else "float32")
    assert man["row_dtype"] == {"float32": "<f4", "float16": "<f2",
                                "bfloat16": "<u2"}[dtype if raw else "float32"]


def test_each_shard_resets_on_its_own_and_a_reset_rotates(tmp_path):
    """Three shards, paged reads; one shard reloaded (a new lineage), another read from
    behind its tombstones: each is reset alone, and replay still equals every shard."""
    rng = np.random.default_rng(3)
    src = Shards(3, _spec(eviction=(Capacity(max_rows=20, policy="lru"),)))
    opt = AdaGrad(learning_rate=0.1)

    def step():
        for s, t in enumerate(src.tables):        # shard s holds the IDs = s mod 3
            ids = rng.integers(0, 100, 10) * 3 + s
            t.lookup(ids)
            t.push(ids, rng.standard_normal((10, 4)).astype(np.float32), optimizer=opt)
            t.sweep(40)

    sink = FileSink(tmp_path, "emb", max_deltas=100, fsync=False)
    sub = src.subscribe("emb", since=sink.position())
    step()
    assert sink.write(sub.poll()).endswith("-full.npz")
    for _ in range(3):
        step()
        assert sink.write(sub.poll()).endswith("-delta.npz")
    _same(tmp_path, src.tables, raw=False)
    lineages = [t.lineage for t in src.tables]
    src.reload(1)
    step()
    batches = sub.poll()
    assert {b.shard for b in batches if b.reset} == {1}
    assert sink.write(batches).endswith("-full.npz")       # F5: a reset rotates
    _same(tmp_path, src.tables, raw=False)
    assert [t.lineage for t in src.tables][::2] == lineages[::2]
    # shard 2 falls behind its tombstones: the stream reads it whole, alone
    src.tables[2].tombs = TombLog(limit=2, floor=src.tables[2].tombs.floor)
    for _ in range(4):
        step()
    batches = sub.poll()
    assert {b.shard for b in batches if b.reset} == {2}
    sink.write(batches)
    _same(tmp_path, src.tables, raw=False)
    assert len(sink.segments) == 1 and len(list(tmp_path.glob("seg-*"))) == 1


def test_rotation_by_bytes(tmp_path):
    rng = np.random.default_rng(4)
    kv = mx.kv.create("local")
    kv.init("emb", _spec(eviction=()))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    _train(kv, rng, 3)
    sink = FileSink(tmp_path, "emb", max_deltas=1000, max_bytes=3000, fsync=False)
    sub = kv.subscribe("emb")
    kinds = []
    for _ in range(12):
        _train(kv, rng, 1)
        kinds.append(sink.write(sub.poll()).rsplit("-", 1)[1])
        man = json.loads((tmp_path / MANIFEST).read_text())
        assert sum(e["bytes"] for e in man["segments"][1:]) <= 3000 + 2000
    assert kinds[0] == "full.npz" and kinds.count("full.npz") >= 3, kinds
    assert "delta.npz" in kinds
    _same(tmp_path, [_table(kv)], raw=False)


def test_a_restarted_sink_goes_on_with_deltas(tmp_path):
    rng = np.random.default_rng(5)
    kv = mx.kv.create("local")
    kv.init("emb", _spec())
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    _train(kv, rng, 4)
    with FileSink(tmp_path, "emb", fsync=False) as sink:
        run_sink(kv, "emb", sink, polls=2, interval=0)
        first = sink.segments
        pos = sink.position()
    assert len(first) == 1 and first[0].endswith("-full.npz")
    (tmp_path / "seg-00000099-delta.npz").write_bytes(b"a crash's leftover")
    (tmp_path / "manifest.json.tmp").write_text("{")
    _train(kv, rng, 3)
    with FileSink(tmp_path, "emb", fsync=False) as sink:       # a "restart"
        assert sink.position() == pos
        assert not (tmp_path / "seg-00000099-delta.npz").exists()   # F8: orphans removed
        assert not (tmp_path / "manifest.json.tmp").exists()
        run_sink(kv, "emb", sink, polls=1, interval=0)
        assert sink.segments[:1] == first and len(sink.segments) == 2
        assert sink.segments[1].endswith("-delta.npz")
        assert sink.write(kv.subscribe("emb", since=sink.position()).poll()) is None
    _same(tmp_path, [_table(kv)], raw=False)


def test_run_sink_stops_when_told(tmp_path):
    kv = mx.kv.create("local")
    kv.init("emb", _spec())
    kv.lookup("emb", np.arange(5))
    stop = threading.Event()
    with FileSink(tmp_path, "emb", fsync=False) as sink:
        t = threading.Thread(target=run_sink, args=(kv, "emb", sink),
                             kwargs=dict(stop=stop, interval=0.01))
        t.start()
        stop.set()
        t.join(timeout=30)
        assert not t.is_alive()
    assert len(replay(tmp_path)) == 5
    with pytest.raises(ConfigError, match="interval"):
        run_sink(kv, "emb", FileSink(tmp_path / "b", "emb"), interval=-1)


def _written(tmp_path: Path) -> Path:
    kv = mx.kv.create("local")
    kv.init("emb", _spec())
    kv.lookup("emb", np.arange(40))
    with FileSink(tmp_path, "emb", fsync=False) as sink:
        sink.write(kv.subscribe("emb").poll())
        kv.push("emb", (np.arange(3), np.ones((3, 4), np.float32)))
        sink.write(kv.subscribe("emb", since=sink.position()).poll())
    return tmp_path


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / MANIFEST).write_text('{"format": "pskv-sink/1", "ke'), "not JSON"),
    (lambda d: (d / MANIFEST).write_text("[]"), "lacks one of"),
    (lambda d: (d / MANIFEST).write_text(json.dumps(
        {**json.loads((d / MANIFEST).read_text()), "format": "other/9"})), "format"),
    (lambda d: (d / MANIFEST).write_text(json.dumps(
        {**json.loads((d / MANIFEST).read_text()),
         "segments": json.loads((d / MANIFEST).read_text())["segments"][1:]})),
     "one full snapshot followed by deltas"),
])
def test_a_damaged_manifest_is_refused(tmp_path, damage, match):
    d = _written(tmp_path)
    damage(d)
    with pytest.raises(CheckpointError, match=match):
        replay(d)
    with pytest.raises(CheckpointError, match=match):
        FileSink(d, "emb")
    FileSink(d / "fresh", "emb").close()          # the failed sink let the lock go
    with pytest.raises(CheckpointError, match=match):
        FileSink(d, "emb")


def test_a_truncated_or_altered_segment_is_refused(tmp_path):
    d = _written(tmp_path)
    man = json.loads((d / MANIFEST).read_text())
    seg = d / man["segments"][1]["file"]
    data = seg.read_bytes()
    seg.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{seg.name} is damaged: its size or sha256"):
        replay(d)
    seg.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="sha256"):
        replay(d)
    # a consistent manifest over a file that is no archive: np.load's complaint, named
    seg.write_bytes(b"not a zip file at all")
    import hashlib
    man["segments"][1].update(bytes=seg.stat().st_size,
                              sha256=hashlib.sha256(seg.read_bytes()).hexdigest())
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match=f"{seg.name} is damaged"):
        replay(d)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        replay(d / "nothing")


def test_a_reader_racing_a_rotation_reads_the_manifest_again(tmp_path, monkeypatch):
    """F7: a named segment gone (a rotation deleted it after the reader read the manifest)
    is read again; gone every time, it is an error that says so."""
    import pskv.sinks._files as files
    d = _written(tmp_path)
    real, calls = files.load_segment, []

    def racing(*args, **kw):
        calls.append(args[1]["file"])
        if len(calls) == 1:
            raise FileNotFoundError(args[1]["file"])
        return real(*args, **kw)
    monkeypatch.setattr(files, "load_segment", racing)
    assert len(replay(d)) == 40 and calls[0] == calls[1]

    def gone(*args, **kw):
        raise FileNotFoundError(args[1]["file"])
    monkeypatch.setattr(files, "load_segment", gone)
    monkeypatch.setattr(files.time, "sleep", lambda s: None)
    with pytest.raises(CheckpointError, match="names segments that are gone"):
        replay(d)


def test_a_segment_whose_positions_disagree_with_the_manifest_is_refused(tmp_path):
    d = _written(tmp_path)
    man = json.loads((d / MANIFEST).read_text())
    man["segments"][0]["position"]["0"][1] += 1
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match="the manifest says"):
        replay(d)


def test_wrong_use_is_refused_with_what_to_do(tmp_path):
    kv = mx.kv.create("local")
    kv.init("emb", _spec())
    kv.init("other", _spec(dim=3))
    kv.lookup("emb", np.arange(4))
    kv.lookup("other", np.arange(4))
    sink = FileSink(tmp_path, "emb", fsync=False)
    with pytest.raises(ConfigError, match="another FileSink writes"):
        FileSink(tmp_path, "emb")
    pos = kv.subscribe("emb").poll()[0].position
    delta = kv.subscribe("emb", since={"0": list(pos)}).poll()
    with pytest.raises(ConfigError, match="since=sink.position"):
        sink.write(delta)                          # a first write that is not whole
    with pytest.raises(ConfigError, match="one sink per table"):
        sink.write(kv.subscribe("other").poll())
    sink.write(kv.subscribe("emb").poll())
    with pytest.raises(ShapeMismatchError, match="Subscribe with the same raw"):
        sink.write([dataclasses.replace(b, rows=b.rows.astype(np.float16))
                    for b in kv.subscribe("emb").poll()])
    sink.close()
    with pytest.raises(ConfigError, match="closed"):
        sink.write(kv.subscribe("emb").poll())
    with pytest.raises(ConfigError, match="holds table 'emb', not 'other'"):
        FileSink(tmp_path, "other")
    with pytest.raises(ConfigError, match="raw=True"):
        FileSink(tmp_path, "emb", raw=True)
    for bad in (dict(max_deltas=-1), dict(max_bytes="big"), dict(raw=1)):
        with pytest.raises(ConfigError):
            FileSink(tmp_path / "x", "emb", **bad)


# ---- the command ----------------------------------------------------------------------
def test_the_command_refuses_bad_arguments_with_exit_2(tmp_path, capsys):
    for argv, said in [([], "--key"), (["--key", "emb"], "--to"),
                       (["--key", "emb", "--to", "ftp://x"], "neither file:DIR nor redis"),
                       (["--key", "emb", "--to", "redis://h:notaport/0"], "bad port"),
                       (["--key", "emb", "--to", "redis://h:6379/zero"], "database"),
                       (["--key", "emb", "--to", "rediss://h:6379/0"], "TLS"),
                       (["--key", "emb", "--to", "file:"], "names no directory"),
                       (["--key", "", "--to", f"file:{tmp_path}"], "--key is empty"),
                       (["--key", "emb", "--to", f"file:{tmp_path}", "--interval", "-1"],
                        "--interval")]:
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2, argv
        assert said in capsys.readouterr().err, argv


def test_the_command_without_a_job_source_says_so(tmp_path, capsys, monkeypatch):
    import pskv.sinks._run as run

    def missing():
        raise ConfigError("this pskv has no pskv.stream.Reader to read a job's change stream")
    monkeypatch.setattr(run, "_source", missing)
    assert main(["--key", "emb", "--to", f"file:{tmp_path}"]) == 2
    assert "pskv.stream.Reader" in capsys.readouterr().err


def test_the_command_feeds_the_sink_from_its_source(tmp_path, monkeypatch):
    """With a source in place of a job's (``_source``), the command writes its files and
    ends on SIGTERM's event (here: a poll that sets it)."""
    import pskv.sinks._run as run
    kv = mx.kv.create("local")
    kv.init(7, _spec())
    kv.lookup(7, np.arange(6))
    real = run.run_sink

    def once(source, key, sink, *, interval, stop):
        assert key == 7 and interval == 0.5 and not sink.raw
        return real(source, key, sink, interval=interval, stop=stop, polls=1)
    monkeypatch.setattr(run, "_source", lambda: kv)
    monkeypatch.setattr(run, "run_sink", once)
    assert main(["--key", "7", "--to", f"file:{tmp_path}", "--interval", "0.5"]) == 0
    assert len(replay(tmp_path)) == 6


def test_keys_and_targets_as_typed(tmp_path):
    assert _key("7") == 7 and _key("-3") == -3 and _key("emb") == "emb" and _key("7a") == "7a"
    sink = make_sink(f"file:{tmp_path}", "emb")
    assert isinstance(sink, FileSink) and sink.directory == tmp_path
    sink.close()
    with pytest.raises(ConfigError, match="neither"):
        make_sink("s3://bucket", "emb")


def test_the_sink_command_waits_for_its_key_to_be_initialized() -> None:
    """Started beside a job, the sink may ask before the workers' kv.init (CI found it
    exiting: "key ... is not on server 0"): it waits, bounded."""
    import threading

    from pskv.errors import KeyNotInitializedError
    from pskv.sinks._run import wait_for_key

    class Early:
        asked = 0

        def versions(self, key: str) -> list[int]:
            self.asked += 1
            if self.asked < 3:
                raise KeyNotInitializedError(f"key {key!r} is not on server 0")
            return [0, 0]

    src = Early()
    wait_for_key(src, "emb", threading.Event(), timeout=30)
    assert src.asked == 3
    with pytest.raises(KeyNotInitializedError, match="not on server 0"):
        wait_for_key(Early(), "emb", threading.Event(), timeout=0)
