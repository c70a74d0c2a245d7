"""Keys no store optimizer may update: the gradient keys of a DistributedOptimizer.

A ``pskv.torch.DistributedOptimizer`` with ``update_on_kvstore=False`` pushes gradients to
its keys and pulls their sum back into ``.grad``; a store optimizer (``kv.set_optimizer``,
or a local store's ``set_updater``) would run on those sums as if they were weights, and
the torch optimizer would then step with whatever it left there (AdaGrad over the buckets
took a CTR model's loss from 7 to 15,000, with no error). So a store refuses the pair
whichever comes first: a DistributedOptimizer over a store that has an optimizer
(:meth:`GradientKeys.check`) and ``set_optimizer`` on a store that holds such keys
(:meth:`GradientKeys.refuse_optimizer`). Table keys train with their own row optimizer
(``TableSpec(..., optimizer=...)``), which these checks leave alone.
"""
from __future__ import annotations

from typing import Callable

from ..errors import ConfigError

__all__ = ["GradientKeys"]


class GradientKeys:
    """The key prefixes of one store's DistributedOptimizers (``update_on_kvstore=False``).

    Parameters
    ----------
    store_type : str
    updates : callable
        ``updates()``: what updates the store's values on push (e.g. ``"optimizer
        AdaGrad"``), or None when pushes assign.
    """

    def __init__(self, store_type: str, updates: Callable[[], str | None]) -> None:
        self.store_type = store_type
        self._updates = updates
        #: prefix -> how many DistributedOptimizers hold it
        self.prefixes: dict[str, int] = {}

    def check(self, prefix: str) -> None:
        """ConfigError if the store has an optimizer that would update gradient keys."""
        what = self._updates()
        if what is not None:
            raise ConfigError(
                f"DistributedOptimizer(update_on_kvstore=False) on a {self.store_type!r} "
                f"store that has an {what}: the store would run it on the gradient keys "
                f"({prefix!r} + 'bucket.N') as if they were weights, so step() would get "
                "updated sums instead of the workers' gradients. Train table keys with their "
                "own optimizer, TableSpec(..., optimizer=mx.optimizer.AdaGrad(...)), and "
                "call no kv.set_optimizer; or pass update_on_kvstore=True with "
                "kv_optimizer= to train the whole model with the store's optimizer.",
                key=prefix, store_type=self.store_type)

    def hold(self, prefix: str) -> None:
        """Remember a DistributedOptimizer's keys (after :meth:`check`)."""
        self.prefixes[prefix] = self.prefixes.get(prefix, 0) + 1

    def release(self, prefix: str) -> None:
        """Forget one holder of ``prefix`` (its DistributedOptimizer was closed)."""
        left = self.prefixes.get(prefix, 0) - 1
        if left > 0:
            self.prefixes[prefix] = left
        else:
            self.prefixes.pop(prefix, None)

    def refuse_optimizer(self, action: str) -> None:
        """ConfigError if a DistributedOptimizer's gradient keys are held (``action``:
        ``'set_optimizer'`` or ``'set_updater'``); changes nothing."""
        if not self.prefixes:
            return
        prefix = sorted(self.prefixes)[0]
        raise ConfigError(
            f"{action} on this {self.store_type!r} store: a DistributedOptimizer "
            f"(update_on_kvstore=False, prefix={prefix!r}) pushes its gradients here and "
            "pulls their sum back, and a store optimizer would update those sums as if they "
            "were weights. To train table keys, give each its own optimizer: "
            "TableSpec(..., optimizer=mx.optimizer.AdaGrad(...)); to train the whole model "
            "with the store's optimizer, build the DistributedOptimizer with "
            "update_on_kvstore=True, kv_optimizer=...; or close() it first.",
            key=prefix, store_type=self.store_type)
