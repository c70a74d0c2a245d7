"""The size bounds of a request (``_ps/bounds.py``) and the untrusted ``.npz`` reader
(``nd/_npz.py``), without sockets."""
from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pskv._ps.bounds import check_init, check_key_count, check_reply, key_bytes, placement
from pskv.errors import CheckpointError, LimitError, ShapeMismatchError
from pskv.kvstore._snapshot import checkpoint_path
from pskv.nd._npz import BadArchive, SafeNpz, open_regular, read_bounded


def test_key_bytes_count_row_ids_without_allocating() -> None:
    assert key_bytes((2 ** 34, 0), 4, sparse=True) == 2 ** 37
    assert key_bytes((2 ** 34, 0), 4, sparse=False) == 0
    assert key_bytes((10 ** 12,), 4, sparse=False) == 4 * 10 ** 12
    assert key_bytes((), 8, sparse=False) == 8


@pytest.mark.parametrize("place, sparse, part, ok", [
    ([0, 6, [2, 3]], False, np.ones((2, 3)), True),         # the whole key, its shape
    ([0, 6, [2, 3]], False, np.ones(6), True),              # the whole key, flat
    ([2, 5, [2, 3]], False, np.ones(3), True),              # a segment
    ([2, 5, [2, 3]], False, np.ones((3, 1)), False),        # a segment is flat
    ([5, 8, [6]], False, np.ones(3), False),                # past the key's end
    ([3, 1, [6]], False, np.ones(0), False),                # start past stop
    ([0, 3, [-3]], False, np.ones(3), False),               # a negative dimension
    ([0, 3, "3"], False, np.ones(3), False),
    ("x", False, np.ones(3), False),
    ([0.0, 3, [3]], False, np.ones(3), False),
    ([1, 3, [4, 5]], True, np.ones((2, 5)), True),          # rows 1-2 of a row_sparse key
    ([1, 3, [4, 5]], True, np.ones((2, 6)), False),         # rows of another width
])
def test_placements_must_describe_their_part(place: Any, sparse: bool, part: np.ndarray,
                                             ok: bool) -> None:
    if ok:
        got = placement("k", part, sparse, place)
        assert got == (place[0], place[1], tuple(place[2]))
    else:
        with pytest.raises(ShapeMismatchError):
            placement("k", part, sparse, place)


def test_init_bounds_name_the_setting_and_check_the_whole_key() -> None:
    part = np.ones(3, np.float32)
    with pytest.raises(LimitError, match="PSKV_MAX_KEY_BYTES=1024"):
        check_init([{"key": 1, "place": [0, 3, [10 ** 12]]}], [part], 1024, "server 0")
    with pytest.raises(LimitError, match="row_sparse"):
        check_init([{"key": 1, "stype": "row_sparse"}], [np.empty((1 << 20, 0))], 1024, "s")
    assert check_init([{"key": 1}], [part], 1024, "s") == [None]


def test_key_count_and_reply_bounds() -> None:
    check_key_count(64, 64, "PULL", "server 0")
    with pytest.raises(LimitError, match="PSKV_MAX_KEYS_PER_MESSAGE"):
        check_key_count(65, 64, "PULL", "server 0")
    table = np.ones((4, 16), np.float32)                  # rows of 64 bytes
    check_reply([table], [np.zeros(2, np.int64)], 2 * 72, "s")
    with pytest.raises(LimitError, match="PSKV_MAX_REPLY_BYTES"):
        check_reply([table], [np.zeros(3, np.uint8)], 2 * 72, "s")
    with pytest.raises(LimitError):
        check_reply([table] * 3, None, 2 * table.nbytes, "s")


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def test_safe_npz_reads_what_np_savez_wrote() -> None:
    a, f = np.arange(6, dtype=np.int32).reshape(2, 3), np.asfortranarray(np.ones((2, 3)))
    with SafeNpz(_npz(a=a, f=f, e=np.zeros((0, 4))), "test") as z:
        assert sorted(z.files) == ["a", "e", "f"]
        np.testing.assert_array_equal(z["a"], a)
        np.testing.assert_array_equal(z["f"], f)
        assert z["e"].shape == (0, 4)
        assert z.shape_of("a") == ((2, 3), np.dtype(np.int32))
        z["a"][0, 0] = 7                                   # a writable copy


def test_safe_npz_refuses_compressed_lying_and_object_members() -> None:
    buf = io.BytesIO()
    np.savez_compressed(buf, a=np.zeros(1000))
    with pytest.raises(BadArchive, match="compressed"):
        SafeNpz(buf.getvalue(), "test")
    from numpy.lib import format as npy
    member = io.BytesIO()
    npy.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False,
                                        "shape": (10 ** 9,)})  # declares 4 GB, holds 16 B
    lying = io.BytesIO()
    with zipfile.ZipFile(lying, "w") as zf:
        zf.writestr("a.npy", member.getvalue() + bytes(16))
    with pytest.raises(BadArchive, match="does not hold"):
        SafeNpz(lying.getvalue(), "test")["a"]
    with pytest.raises(BadArchive):
        SafeNpz(b"not a zip", "test")
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as zf:
        zf.writestr("x.txt", b"hello")
    with pytest.raises(BadArchive, match="not one .npy"):
        SafeNpz(zbuf.getvalue(), "test")


def test_only_regular_files_are_opened_and_reads_are_bounded(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(BadArchive, match="not a regular file"):
        open_regular(str(tmp_path / "fifo"))               # would block without O_NONBLOCK
    with pytest.raises(BadArchive, match="not a regular file"):
        open_regular(str(tmp_path))
    (tmp_path / "big").write_bytes(b"x" * 100)
    assert read_bounded(str(tmp_path / "big"), 100) == b"x" * 100
    with pytest.raises(BadArchive, match="larger"):
        read_bounded(str(tmp_path / "big"), 99)


def test_checkpoint_paths_under_the_checkpoint_dir(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    (root / "up").symlink_to(tmp_path)
    assert checkpoint_path(str(root / "a" / "b"), str(root)) == str(root / "a" / "b")
    assert checkpoint_path(str(tmp_path / "x")) == str(tmp_path / "x")    # no dir: anywhere
    for bad in (tmp_path / "x", root / ".." / "x", root / "up" / "x"):
        with pytest.raises(CheckpointError, match="PSKV_CHECKPOINT_DIR"):
            checkpoint_path(str(bad), str(root))
    with pytest.raises(CheckpointError, match="NUL"):
        checkpoint_path("a\x00b", str(root))
