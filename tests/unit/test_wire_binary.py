"""The binary header of the hot path: round trips of every command, and every malformed
form rejected with ProtocolError (never another exception)."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pskv._ps.message import (
    ALLOWED_DTYPES,
    BINARY_TAG,
    DTYPE_CODES,
    MAX_HEADER,
    WIRE_DTYPES,
    Command,
    Meta,
    decode,
    encode,
    parse_header,
)
from pskv.errors import ProtocolError

FIXED = struct.Struct("<BBBxqII")


def raw(frames: list) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


def test_dtype_codes_name_every_allowed_dtype_once() -> None:
    assert sorted(DTYPE_CODES) == sorted(WIRE_DTYPES)
    assert len(set(DTYPE_CODES)) == len(DTYPE_CODES) and ALLOWED_DTYPES <= WIRE_DTYPES


@pytest.mark.parametrize("cmd", list(Command), ids=[c.name for c in Command])
def test_every_command_round_trips_binary(cmd: Command) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([5, -1], np.int64)
    for keys, body, arrays in [((), None, []), ((4, -6, 1 << 62), None, [a]),
                               ((2, 8), {"kinds": "dr"}, [a, b, a])]:
        frames = raw(encode(cmd, -(1 << 61), keys, body, arrays))
        assert frames[0][0] == BINARY_TAG
        meta, got = decode(frames)
        assert meta == Meta(cmd, -(1 << 61), tuple(keys), body)
        assert len(got) == len(arrays)
        for g, w in zip(got, arrays):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", DTYPE_CODES)
def test_every_dtype_and_rank_round_trips(name: str) -> None:
    for shape in [(), (0,), (3,), (2, 0, 4), (1,) * 32]:
        a = np.ones(shape, name)
        _, got = decode(raw(encode(Command.DATA, 3, arrays=[a])))
        assert got[0].dtype == np.dtype(name) and got[0].shape == shape


@pytest.mark.parametrize("body", [{"group": "all"}, {"kinds": 3}, {"kinds": "d", "x": 1},
                                  {"kinds": "\u00e9"}, [1], "text", 0])
def test_other_bodies_travel_as_json(body: object) -> None:
    frames = raw(encode(Command.COMMAND, 9, [2], body))
    assert json.loads(frames[0])["b"] == body
    assert decode(frames)[0] == Meta(Command.COMMAND, 9, (2,), body)


def test_numbers_beyond_64_bits_travel_as_json() -> None:
    frames = raw(encode(Command.PULL, 1, [1 << 70]))
    assert json.loads(frames[0])["k"] == [1 << 70]
    assert decode(frames)[0].keys == (1 << 70,)


def good() -> bytes:
    return raw(encode(Command.PUSH, 7, [2, 4], {"kinds": "dd"},
                      [np.zeros((2, 3), np.float32), np.zeros(5, np.int8)]))[0]


def test_every_truncation_is_rejected() -> None:
    head = good()
    for n in range(1, len(head) - 2):      # the last two bytes are kind letters: "" and "d"
        with pytest.raises(ProtocolError):
            parse_header(head[:n], 2)


def fixed(cmd: int = int(Command.PULL), flags: int = 0, ts: int = 1, nkeys: int = 0,
          narrays: int = 0) -> bytes:
    return FIXED.pack(BINARY_TAG, cmd, flags, ts, nkeys, narrays)


BAD = {
    "unknown command": (fixed(cmd=99), 0, "Command"),
    "unknown flags": (fixed(flags=6), 0, "flags"),
    "ts too big": (fixed(ts=1 << 62), 0, "ts"),
    "ts too small": (fixed(ts=-(1 << 62)), 0, "ts"),
    "too many keys": (fixed(nkeys=(1 << 24) + 1), 0, "too many"),
    "too many arrays": (fixed(narrays=(1 << 20) + 1), None, "too many"),
    "keys missing": (fixed(nkeys=3) + b"\0" * 16, 0, "fit"),
    "frames mismatch": (fixed(narrays=1) + b"\0\1" + b"\0" * 8, 2, "data frames"),
    "dtype code": (fixed(narrays=1) + bytes([len(DTYPE_CODES), 1]) + b"\0" * 8, 1, "dtype"),
    "too many dims": (fixed(narrays=1) + bytes([0, 33]) + b"\0" * 8 * 33, 1, "shape"),
    "huge dim": (fixed(narrays=1) + bytes([0, 1]) + struct.pack("<Q", 1 << 40), 1, "shape"),
    "dims missing": (fixed(narrays=1) + bytes([0, 2]) + b"\0" * 8, 1, "fit"),
    "trailing bytes": (fixed() + b"x", 0, "after"),
    "kinds not ascii": (fixed(flags=1) + "\u00e9".encode(), 0, "ASCII"),
}


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_malformed_binary_headers_are_rejected(case: tuple[bytes, int | None, str]) -> None:
    head, nframes, match = case
    with pytest.raises(ProtocolError, match=match):
        parse_header(head, nframes)


def test_oversized_binary_header_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_header(bytes([BINARY_TAG]) + b"\0" * MAX_HEADER)


def test_wrong_frame_length_is_rejected() -> None:
    frames = raw(encode(Command.DATA, 1, arrays=[np.zeros(3, np.float32)]))
    with pytest.raises(ProtocolError, match="expected"):
        decode([frames[0], frames[1][:-1]])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 3))
def test_garbage_after_the_tag_raises_only_protocol_error(tail: bytes, nframes: int) -> None:
    try:
        meta, specs = parse_header(bytes([BINARY_TAG]) + tail, nframes)
    except ProtocolError:
        return
    assert len(specs) == nframes          # what passes is consistent
    assert all(n >= 0 for _, _, n in specs) and isinstance(meta.ts, int)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=20, unique=True),
       st.text(alphabet="dcr", max_size=20), st.integers(-(1 << 62) + 1, (1 << 62) - 1))
def test_binary_round_trip_property(keys: list[int], kinds: str, ts: int) -> None:
    meta, _ = decode(raw(encode(Command.PUSHPULL, ts, keys, {"kinds": kinds})))
    assert meta == Meta(Command.PUSHPULL, ts, tuple(keys), {"kinds": kinds})
