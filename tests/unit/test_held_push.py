"""HeldPush: the rule for the one small dist_sync push a worker may hold back."""
from __future__ import annotations

import numpy as np

from pskv.kvstore.dist._held import HeldPush


def items(nbytes: int, kinds: str = "d") -> dict[int, tuple[list[int], str, list[np.ndarray]]]:
    return {0: ([2], kinds, [np.ones(nbytes // 4, np.float32)])}


def test_small_dense_push_is_held_as_a_copy_and_rides_the_next_pull_of_its_keys() -> None:
    held = HeldPush(64)
    pushed = items(16)
    assert held.hold([3], pushed) and held
    pushed[0][2][0][:] = 7                       # the caller reuses its array at once
    assert held.take_for_pull([4]) is None and held   # another key: not carried
    got = held.take_for_pull([3])
    assert got is not None and not held
    np.testing.assert_array_equal(got[0][2][0], np.ones(4))


def test_what_is_never_held() -> None:
    assert not HeldPush(64).hold([3], items(128))          # too big
    assert not HeldPush(0).hold([3], items(4))             # holding off (dist_async, 0)
    assert not HeldPush(64).hold([3], {0: ([2], "r", [np.zeros(1, np.int64),
                                                      np.zeros((1, 2), np.float32)])})
    held = HeldPush(64)
    assert held.hold([3], items(4)) and not held.hold([4], items(4))   # one at a time


def test_any_other_call_releases_it() -> None:
    held = HeldPush(64)
    held.hold([3], items(8))
    assert held.release() is not None and held.release() is None and not held
