"""The command line the training examples share: the same flags with the same meaning.

``train``, ``train_torch``, ``sparse_logreg`` and ``train_ctr`` each call
:func:`build_parser` and add their own flags. Invariant: ``--batch-size`` is per worker everywhere (the global batch is
``num_workers`` times it), ``--epochs`` are counted from 1, and ``--kv-store`` takes the
same :data:`STORE_TYPES` in every example.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Sequence

__all__ = ["STORE_TYPES", "build_parser", "check_args", "create_store", "nonnegative_float",
           "nonnegative_int", "parse_checked", "positive_float", "positive_int"]

#: the store types every example accepts; ``dist_*`` need pskv-launch
STORE_TYPES = ("local", "device", "dist_sync", "dist_async", "dist_device_sync")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _int_from(text, 1, "an integer")


def nonnegative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    return _int_from(text, 0, "a whole number")


def _int_from(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be zero or a positive number")
    return value


def build_parser(prog: str, description: str, *, epochs: int, batch_size: int,
                 lr: float | None, lr_help: str | None = None,
                 update_on_kvstore: int | None = None) -> argparse.ArgumentParser:
    """A parser with the flags every training example has, and the given defaults.

    ``update_on_kvstore`` None leaves ``--update-on-kvstore`` out (an example whose
    optimizer always runs on the servers); 0 or 1 adds it with that default.
    """
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--kv-store", default="local", choices=STORE_TYPES,
                   help="store type (default: local); dist_* need pskv-launch")
    p.add_argument("--epochs", type=positive_int, default=epochs,
                   help=f"epochs, counted from 1 (default: {epochs})")
    p.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help=f"samples per worker per step (default: {batch_size}); the global "
                        "batch is num_workers times this")
    p.add_argument("--lr", type=positive_float, default=lr,
                   help=lr_help or f"learning rate (default: {lr})")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the data, the order and the initialization (default: 0)")
    if update_on_kvstore is not None:
        mode = {1: "1: the store runs the optimizer", 0: "0: every worker runs it"}
        p.add_argument("--update-on-kvstore", type=int, choices=(0, 1),
                       default=update_on_kvstore,
                       help=f"{mode[1]}; {mode[0]} on the pulled sum of the gradients "
                            f"(default: {update_on_kvstore})")
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many steps in all (for quick checks)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="save the loss and metric curves to this image (rank 0)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress and no per-epoch lines; only the final summary")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks across flags every example shares; a bad combination exits 2."""
    if "async" in args.kv_store and getattr(args, "update_on_kvstore", 1) == 0:
        # as MXNet's gluon.Trainer: summed gradients mean nothing when pushes never meet
        parser.error(f"--update-on-kvstore 0 needs a synchronous store; {args.kv_store} "
                     "applies each push on its own. Use --update-on-kvstore 1 or dist_sync.")


def parse_checked(parser: argparse.ArgumentParser,
                  argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` then :func:`check_args`; bad flags exit 2 (argparse)."""
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def create_store(prog: str, kv_store: str) -> Any:
    """``pskv.kv.create(kv_store)``, or None after one line on stderr saying why not (the
    example then exits 2)."""
    import pskv as mx
    try:
        return mx.kv.create(kv_store)
    except mx.KVStoreError as err:
        print(f"{prog}: cannot create a {kv_store!r} store: {err}", file=sys.stderr)
        return None
