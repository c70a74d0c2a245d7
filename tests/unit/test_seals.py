"""A restarted worker's seals and reads in the step it resumes at (``pskv._ps.seals`` W3,
docs/data.md D4), without sockets: the commit of the resumed step goes once the pushes the
shards hold are made again (or when the next step begins), not at the step's first wait,
and until then its reads of those keys read the values as they are."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest

from pskv._ps import validate
from pskv._ps.message import Command, Meta
from pskv._ps.replay import PushLog
from pskv._ps.seals import Seals
from pskv.errors import ProtocolError


class _Links:
    """Records the SEAL commands a Seals sends; every confirmation is answered."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, bool, int]] = []

    def request(self, server: int, cmd: Command, keys: Sequence[int] = (), body: Any = None,
                arrays: Sequence[np.ndarray] = (), negative: bool = False) -> int:
        self.sent.append((server, bool(body["commit"]), int(body["step"])))
        return len(self.sent)

    def wait(self, ts: int, timeout: float | None = None, what: str = "") -> Any:
        return None, []

    def commits(self) -> list[tuple[int, int]]:
        out = [(s, t) for s, commit, t in self.sent if commit]
        self.sent.clear()
        return out


def test_the_resumed_step_is_committed_after_its_pushes_are_made_again() -> None:
    links = _Links()
    seals = Seals(links, step=7)
    seals.resumed({0, 1})
    seals.seal()                         # the step's first wait: a pull before its pushes
    assert links.commits() == []
    seals.tagged(0, None)                # shard 0's held pushes made again (dropped)
    seals.seal()
    assert links.commits() == [(0, 7)]
    seals.advance(7)                     # the sampler's first step is the resumed one
    assert links.commits() == []
    seals.advance(8)                     # it ends: shard 1 is committed even so
    assert links.commits() == [(1, 7)]
    seals.tagged(1, None)
    seals.advance(9)
    assert links.commits() == [(1, 8)]


def test_a_flush_commits_the_resumed_step_everywhere() -> None:
    links = _Links()
    seals = Seals(links, step=3)
    seals.resumed({2})
    seals.seal(final=True)
    assert links.commits() == [(2, 3)] and seals.sealed == 3


def test_the_push_log_says_which_keys_are_still_made_again() -> None:
    log = PushLog(8)
    log.resume(0, {5: (2, 4), 6: (3, 3)})          # key 5: 2 pushes held of the step
    assert log.catching_up(0, [5, 6, 7]) == [5] and log.catching_up(1, [5]) == []
    one = np.ones(3, np.float32)
    for left in ([5], []):
        keys, _body, _arrays = log.drop_applied(0, [5], {"kinds": "d"}, [one])
        assert keys == [] and log.catching_up(0, [5]) == left


def test_a_read_as_it_is_names_true_or_its_own_keys() -> None:
    for now in (True, False, [3]):
        validate.request(Meta(Command.PULL, 1, (3, 4), {"now": now}), [])
    validate.request(Meta(Command.RSP_PULL, 1, (3,), {"now": [3]}), [np.arange(2)])
    for now in ([5], [3, 3], "yes", [True]):
        with pytest.raises(ProtocolError, match="now"):
            validate.request(Meta(Command.PULL, 1, (3, 4), {"now": now}), [])
    body = {"op": "lookup", "key": 3, "train": True, "now": True}
    validate.request(Meta(Command.COMMAND, 1, (), body), [np.arange(2)])
    with pytest.raises(ProtocolError, match="now"):
        validate.request(Meta(Command.COMMAND, 1, (), {**body, "now": 1}), [np.arange(2)])


def test_a_seal_while_another_thread_seals_waits_and_seals_its_own_pushes() -> None:
    """A thread that pushed while another thread's seal was in flight (pskv.torch's
    communication threads) must not go on to wait for its round unsealed: its seal waits
    for the other one, then commits what it pushed since."""
    import threading

    class _Slow(_Links):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.go = threading.Event(), threading.Event()

        def wait(self, ts: int, timeout: float | None = None, what: str = "") -> Any:
            self.entered.set()
            assert self.go.wait(10)
            return None, []

    links = _Slow()
    seals = Seals(links, step=2)
    seals.tagged(0, None)
    first = threading.Thread(target=seals.seal)
    first.start()
    assert links.entered.wait(10)          # the first seal waits for its confirmation
    seals.tagged(1, None)                  # another thread pushes meanwhile, then seals
    second = threading.Thread(target=seals.seal)
    second.start()
    second.join(0.3)
    waited = second.is_alive()
    links.go.set()
    assert waited, "returned before the first seal's commit, its push unsealed"
    first.join(10)
    second.join(10)
    assert links.commits() == [(0, 2), (1, 2)]
