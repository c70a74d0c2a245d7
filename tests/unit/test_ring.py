"""The shared-memory ring beside a primary's link to a backup on the same host
(``_ps/ring.py``): its rules R1-R3, and what a reader refuses, each as the attack or the
misuse it stops. One process plays both sides (the reader maps a copy of the writer's
descriptor; tests/dist/test_fd_passing.py passes it over a Unix socket, as a primary does
to its backup)."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from pskv._ps import ring as ringmod
from pskv._ps.ring import ALIGN, HEADER, RingReader, RingWriter
from pskv.errors import ProtocolError

pytestmark = pytest.mark.skipif(not ringmod.supported(), reason="no sealed memfds here")


def _none(i: int, dtype: Any, shape: Any) -> None:
    return None


def _pair(size: int = 1024) -> tuple[RingWriter, RingReader]:
    w = RingWriter(size)
    return w, RingReader.open(os.dup(w.fd), size, "server 0")


def test_arrays_placed_come_out_equal_and_the_reader_frees_their_room() -> None:
    w, r = _pair()
    a, b = np.arange(10, dtype=np.float32), np.ones((3, 4), np.int64)
    entries = w.place([a, b])
    assert entries == [[0, 40, "<f4", [10]], [ALIGN, 96, "<i8", [3, 4]]]
    got = r.read(entries, _none, 1 << 20)
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], b)
    assert got[0] is not a and r.consumed == 2 * ALIGN + 64


def test_a_batch_that_does_not_fit_writes_nothing_until_the_reader_caught_up() -> None:
    w, r = _pair(1024)
    first = w.place([np.zeros(200, np.float32)])        # 800 bytes
    assert w.place([np.ones(100, np.float32)]) is None  # 400 more: over 1024 unread
    assert w.head == 832
    r.read(first, _none, 1 << 20)
    second = w.place([np.ones(100, np.float32)])        # crosses the end: the next lap
    assert second is not None and second[0][0] == 1024
    np.testing.assert_array_equal(r.read(second, _none, 1 << 20)[0], np.ones(100))


def test_arrays_land_in_the_buffers_the_backup_gives() -> None:
    w, r = _pair()
    buf = np.empty(8, np.float64)
    got = r.read(w.place([np.full(8, 2.5)]), lambda i, d, s: buf, 1 << 20)
    assert got[0] is buf and buf.tolist() == [2.5] * 8
    wrong = np.empty(3, np.float64)                     # a buffer that does not fit: ignored
    got = r.read(w.place([np.full(8, 1.5)]), lambda i, d, s: wrong, 1 << 20)
    assert got[0] is not wrong and got[0].tolist() == [1.5] * 8


@pytest.mark.parametrize("entry, why", [
    ([0, 40, "<f4", [11]], "its shape holds 44 bytes"),
    ([2000, 40, "<f4", [10]], "does not lie after"),     # past the end of the data
    ([1000, 40, "<f4", [10]], "does not lie after"),     # crosses the end
    ([0, 40, "|O", [5]], "only bool, int and float"),
    ([0, 40, "V40", [1]], "only bool, int and float"),
    ([0, 40, "no such", [10]], "not a NumPy dtype"),
    ([0, -1, "<f4", [10]], "of ints"),
    ([0, 40, "<f4", [10, -1]], "of ints"),
    ([0, 40, "<f4", "10"], "of ints"),
    (["0", 40, "<f4", [10]], "of ints"),
    ([0, 40, "<f4"], "position, bytes, dtype, shape"),
])
def test_a_reader_refuses_an_entry_that_breaks_the_rules(entry: list[Any], why: str) -> None:
    w, r = _pair()
    w.place([np.zeros(10, np.float32)])
    with pytest.raises(ProtocolError, match=why):
        r.read([entry], _none, 1 << 20)
    assert r.consumed == 0 and int(np.frombuffer(w._mm, "<u8", 1, 0)[0]) == 0


def test_a_reader_refuses_entries_behind_what_it_read_or_over_the_message_limit() -> None:
    w, r = _pair()
    entries = w.place([np.zeros(10, np.float32)])
    r.read(entries, _none, 1 << 20)
    with pytest.raises(ProtocolError, match="does not lie after"):
        r.read(entries, _none, 1 << 20)                 # the same bytes again
    more = w.place([np.zeros(10, np.float32)])
    with pytest.raises(ProtocolError, match="PSKV_MAX_MESSAGE_BYTES"):
        r.read(more, _none, 39)


def test_a_writer_stops_trusting_a_reader_that_says_it_read_more_than_was_written() -> None:
    w, r = _pair()
    w.place([np.zeros(4, np.float32)])
    np.frombuffer(r._mm, "<u8", 1, 0)[0] = 1 << 40      # a broken (or hostile) backup
    assert w.place([np.zeros(4, np.float32)]) is None and w.broken
    np.frombuffer(r._mm, "<u8", 1, 0)[0] = 0
    assert w.place([np.zeros(4, np.float32)]) is None   # R3: for good


def test_only_a_sealed_memfd_of_the_announced_size_is_mapped(tmp_path: Any) -> None:
    w = RingWriter(1024)
    with pytest.raises(ProtocolError, match="of 1088 bytes, not 2112"):
        RingReader.open(os.dup(w.fd), 2048, "server 0")
    with pytest.raises(ProtocolError, match="positive multiple"):
        RingReader.open(os.dup(w.fd), 1000, "server 0")
    plain = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(plain, HEADER + 1024)
    with pytest.raises(ProtocolError, match="not a memfd"):
        RingReader.open(plain, 1024, "server 0")
    unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, HEADER + 1024)
    with pytest.raises(ProtocolError, match="not sealed"):
        RingReader.open(unsealed, 1024, "server 0")
    with pytest.raises(ProtocolError, match="passed no descriptor"):
        RingReader.open(None, 1024, "server 0")
    for fd in (plain, unsealed):            # open closed them, refused or not
        with pytest.raises(OSError):
            os.fstat(fd)
    w.close()
    w.close()                                           # idempotent
    assert w.place([np.zeros(1)]) is None

