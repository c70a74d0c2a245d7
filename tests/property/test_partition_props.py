"""Partition properties: every element or row lives on exactly one server, in order."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pskv._ps.partition import covers, place, ps_key

units_st = st.integers(0, 5000)
servers_st = st.integers(1, 8)
bound_st = st.integers(1, 10_000)


@given(units=units_st, servers=servers_st, bound=bound_st, per=st.integers(1, 50),
       split=st.booleans(), loads=st.lists(st.integers(0, 10**6), min_size=8, max_size=8))
def test_place_covers_every_unit_once(units: int, servers: int, bound: int, per: int,
                                      split: bool, loads: list[int]) -> None:
    loads = loads[:servers]
    before = list(loads)
    segs = place(units, 4 * per, servers, bound, per, loads, split_always=split)
    if units == 0:
        assert [(s.start, s.stop) for s in segs] == [(0, 0)]
    else:
        assert covers(segs, units)
        hit = np.zeros(units, np.int64)
        for s in segs:
            hit[s.start:s.stop] += 1
        assert (hit == 1).all()
    assert all(0 <= s.server < servers for s in segs)
    assert len({s.server for s in segs}) == len(segs)          # one segment per server
    # the bytes placed are accounted for exactly
    assert sum(loads) - sum(before) == units * 4 * per
    big = units * per >= bound or split
    if servers > 1 and units >= 2 and big:
        assert len(segs) == min(servers, units)
        sizes = [s.size for s in segs]
        assert max(sizes) - min(sizes) <= 1                      # even split
    else:
        assert len(segs) == 1
        assert before[segs[0].server] == min(before)            # the least-loaded server


@given(units=units_st, servers=servers_st, bound=bound_st,
       order=st.permutations(list(range(6))))
def test_placement_is_a_function_of_the_call_sequence(units: int, servers: int, bound: int,
                                                      order: list[int]) -> None:
    # every worker that places the same keys in the same order gets the same table
    sizes = [units // (i + 1) for i in range(6)]
    tables = []
    for _ in range(2):
        loads = [0] * servers
        tables.append([place(sizes[i], 4, servers, bound, 1, loads) for i in order])
    assert tables[0] == tables[1]


@given(st.one_of(st.integers(-(2**200), 2**200), st.text(max_size=30)),
       st.one_of(st.integers(-(2**200), 2**200), st.text(max_size=30)))
def test_ps_key_is_injective_across_kinds(a: int | str, b: int | str) -> None:
    if type(a) is not type(b):
        assert ps_key(a) != ps_key(b)                  # ints even, strs odd
    elif a == b:
        assert ps_key(a) == ps_key(b)
    elif isinstance(a, int):
        assert ps_key(a) != ps_key(b)


@given(st.text(max_size=30))
def test_str_ps_key_fits_a_signed_64_bit_word(name: str) -> None:
    pk = ps_key(name)
    assert pk % 2 == 1 and 0 < pk < 2**63
