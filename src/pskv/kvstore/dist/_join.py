"""``kv.join()`` of a dist store: uneven data, in the spirit of ``hvd.join()`` and DDP's
``Join`` (docs/api.md, "Uneven data").

A worker that ran out of batches calls ``kv.join()``. It sends its held push and waits
until every push it made is applied (then no round waits on it), then tells the scheduler,
which tells every server (``Command.WORKER_LEFT``): from then on the servers count this
worker as having pushed zeros, so each ``dist_sync`` round closes with the other workers'
pushes, and their sum is the sum of those pushes (the divisor, the optimizer's
``rescale_grad``, stays the user's: DDP's default, ``divide_by_initial_world_size=True``).
On the collective path (docs/collective.md) the worker itself adds zeros to the rounds the
others run while it waits (DDP's join hook shadows the all-reduce the same way), and, once
every worker has joined, to the last rounds any worker pushed (the join barrier's payloads
carry every worker's push counts), so every round the others began completes.

``join`` returns once every worker has joined (the rank of the last one to join, as
``hvd.join`` does). A join is one epoch, as a DDP ``Join`` context is: when every worker
has joined, rank 0 tells every server (``Op.JOINED`` with the scheduler's new join epoch)
and the workers meet at a barrier, so the next rounds (the next epoch's, a final
broadcast) count every worker again; a late WORKER_LEFT of the ended epoch is ignored. In
``dist_async`` no round waits on anyone: ``join`` is a barrier that waits for every
worker's pushes to be applied. A worker that closes without joining is not waited for:
rounds and joins that need it fail with a WorkerClosedError naming it. A part of
:class:`.dist.DistKVStore` (:class:`Joining`), given its :class:`._core.WorkerCore` and
its collective path.
"""
from __future__ import annotations

from typing import Any

from ...errors import ClusterError, ClusterTimeoutError, ConfigError, UnsupportedError
from ..._ps.message import Command
from ..._ps.ops import Op, command
from ._collective import PeerSums
from ._core import WorkerCore

__all__ = ["Joining"]


class Joining:
    """``kv.join()`` of a DistKVStore (the store's docstring), and the check that a joined
    worker pushes no more."""

    def __init__(self, core: WorkerCore, peers: PeerSums) -> None:
        self._core, self._peers = core, peers
        #: in kv.join(): the servers may count this worker as zeros, it pushes no more
        self.sent = False

    def join(self, timeout: float | None) -> int:
        """The store's ``join``."""
        core = self._core
        limit = core.cfg.join_timeout if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ConfigError(f"kv.join(timeout={timeout!r}): the timeout must be a positive "
                              "number of seconds (or None for PSKV_JOIN_TIMEOUT).",
                              store_type=core.store_type)
        with core.collective_lock, core.lock:
            core.begin()       # the held push goes first
            with core.unlocked():
                # every push of this worker applied: no round can be waiting on it when
                # the servers hear it joined (a later push of it would be one too many)
                core.kv.flush()
                # from here on the servers may count it as zeros: no push until every
                # worker has joined, even if the wait below times out (join again)
                self.sent = True
                path = self._peers.path
                pushed = path.pushed_all() if path is not None else {}
                poll = path.add_zeros if path is not None else None
                try:
                    payloads = core.po.barrier(
                        "join", {"pushed": {str(k): v for k, v in pushed.items()}},
                        timeout=float(limit), poll=poll)
                except ClusterTimeoutError as err:
                    joined = core.po.membership.joined
                    missing = [r for r in range(core.po.num_workers)
                               if r not in joined and r != core.po.rank]
                    raise ClusterTimeoutError(
                        f"worker {core.po.rank} waited {float(limit):g} s in kv.join() for "
                        f"worker{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing)) or '(none known)'} to join. Call "
                        "kv.join() on every worker once it runs out of data, or raise "
                        "PSKV_JOIN_TIMEOUT / kv.join(timeout=...).",
                        store_type=core.store_type) from err
                if path is not None:
                    # the last rounds any worker began: every joined worker adds zeros
                    upto: dict[int, int] = {}
                    for p in payloads.values():
                        for k, n in _pushed_of(p).items():
                            upto[k] = max(upto.get(k, 0), n)
                    path.add_zeros(upto)
                if core.po.rank == 0:
                    # the next rounds count every worker again: every server knows it
                    # before any worker leaves the barrier below
                    epoch = _field(payloads, "epoch")
                    body = command(Op.JOINED, epoch=epoch)
                    core.kv.wait_all([core.kv.request(s, Command.COMMAND, body=body)
                                       for s in range(core.po.num_servers)],
                                      "the servers to end the join")
            core.collective("join")
            self.sent = False
            return int(max(payloads, key=lambda r: _field({r: payloads[r]}, "order")))

    def check_not_joined(self, what: str = "push") -> None:
        """A joined worker pushes no more (its rounds closed without it)."""
        if self.sent:
            raise UnsupportedError(
                f"worker {self._core.po.rank} is in kv.join() and cannot {what} until every "
                "worker has joined: the other workers' rounds close without it. Call "
                "kv.join() after this worker's last push; pulls still work.",
                store_type=self._core.store_type)


def _field(payloads: dict[str, Any], name: str) -> int:
    """A number the scheduler put in the first of the join's ``payloads`` (``order``:
    where that worker came in the join; ``epoch``: the join epoch that begins)."""
    payload = next(iter(payloads.values()), None)
    value = payload.get(name) if isinstance(payload, dict) else None
    if type(value) is not int or value < 0:
        raise ClusterError(f"the scheduler's join reply has no {name}: {payload!r:.200}")
    return value


def _pushed_of(payload: Any) -> dict[int, int]:
    """A worker's collective push counts, as its join payload carried them."""
    pushed = payload.get("pushed") if isinstance(payload, dict) else None
    if not isinstance(pushed, dict) or not all(
            isinstance(k, str) and k.lstrip("-").isdigit() and type(v) is int and v >= 0
            for k, v in pushed.items()):
        raise ClusterError(f"a join reply with bad push counts: {payload!r:.200}")
    return {int(k): v for k, v in pushed.items()}
