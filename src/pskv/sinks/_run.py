""":func:`run_sink`, the loop that feeds a sink from a table's change stream, and the
``python -m pskv.sinks`` command around it."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any, Iterable, Protocol, Sequence

from ..errors import ConfigError, KeyNotInitializedError, KVStoreError
from ..table import ChangeBatch
from ._files import FileSink
from ._redis import RedisSink
from ._resp import parse_url

__all__ = ["Sink", "Source", "main", "make_sink", "run_sink"]

log = logging.getLogger(__name__)


class Sink(Protocol):
    """What :func:`run_sink` writes to: :class:`FileSink`, :class:`RedisSink`, or yours."""

    raw: bool

    def position(self) -> dict[str, list[Any]] | None:
        """Where the sink's copy is (``since=`` to resume), or None: from the start."""

    def write(self, batches: Iterable[ChangeBatch]) -> object:
        """Apply the batches of one poll."""

    def close(self) -> None:
        """Release what the sink holds."""


class Source(Protocol):
    """Where the stream comes from: a store, or ``pskv.stream.Reader``."""

    def subscribe(self, key: Any, since: Any = None, *, raw: bool = False) -> Any:
        """A reader of table ``key``'s change stream (``kv.subscribe``)."""


def run_sink(source: Source, key: Any, sink: Sink, *, interval: float = 0.2,
             stop: threading.Event | None = None, since: Any = None,
             polls: int | None = None) -> dict[str, list[Any]] | None:
    """Feed ``sink`` table ``key``'s change stream from ``source`` until ``stop`` is set.

    Parameters
    ----------
    source : store or reader
        Anything with ``subscribe(key, since=..., raw=...)``: a ``local`` or ``dist_*``
        store, or ``pskv.stream.Reader``.
    key : int or str
        The table key.
    sink : Sink
        Where the batches go (:class:`FileSink`, :class:`RedisSink`).
    interval : float
        Seconds between two polls (the wait ends early when ``stop`` is set).
    stop : threading.Event, optional
        Set it to end the loop (after the poll in progress is written).
    since : mapping or str, optional
        Where to start; None: where the sink is (``sink.position()``; a new sink: from
        the start, every shard whole).
    polls : int, optional
        End after this many polls (None: only when ``stop`` is set).

    Returns
    -------
    dict or None
        The sink's position at the end.

    Raises
    ------
    ConfigError
        A bad interval or polls; the errors of the source and of the sink pass through
        (the loop ends at the first: a new run resumes from the sink's position).

    Examples
    --------
    >>> import tempfile, numpy as np, pskv as mx
    >>> from pskv.table import TableSpec
    >>> from pskv.sinks import FileSink, replay, run_sink
    >>> kv = mx.kv.create('local')
    >>> kv.init('emb', TableSpec(dim=4))
    >>> _ = kv.lookup('emb', np.arange(3))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with FileSink(d, 'emb') as sink:
    ...         pos = run_sink(kv, 'emb', sink, polls=1)
    ...     len(replay(d))
    3
    """
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) \
            or not 0 <= interval <= 3600:
        raise ConfigError(f"run_sink(interval={interval!r}): give seconds in [0, 3600].",
                          key=key)
    if polls is not None and (isinstance(polls, bool) or not isinstance(polls, int)
                              or polls < 1):
        raise ConfigError(f"run_sink(polls={polls!r}): give a whole number >= 1, or None.",
                          key=key)
    stop = stop if stop is not None else threading.Event()
    start = sink.position() if since is None else since
    sub = source.subscribe(key, since=start, raw=sink.raw)
    done = 0
    while True:
        sink.write(sub.poll())
        done += 1
        if polls is not None and done >= polls:
            break
        if stop.wait(interval):       # bounded: at most ``interval`` seconds
            break
    return sink.position()


#: seconds ``python -m pskv.sinks`` waits for its table key to be initialized: started
#: beside a job (``pskv-launch --sink``), it may ask before the workers' ``kv.init``
KEY_WAIT_S = 300.0


def wait_for_key(source: Any, key: Any, stop: threading.Event,
                 timeout: float = KEY_WAIT_S) -> None:
    """Return once table ``key`` is on every shard of ``source`` (a ``pskv.stream.Reader``'s
    ``versions``, a store's ``table_versions``), or ``stop`` is set; KeyNotInitializedError, saying so, if it is not
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    versions = getattr(source, "versions", None) or source.table_versions     # a store's
    while True:
        try:
            versions(key)
            return
        except KeyNotInitializedError:
            if time.monotonic() >= deadline:
                raise
        if stop.wait(0.2):
            return


# ---- the command ----------------------------------------------------------------------
def _source() -> Source:
    """The stream of the job this process is pointed at (``pskv.stream.Reader.from_env``),
    imported on first use."""
    try:
        from ..stream import Reader  # type: ignore[import-not-found,attr-defined,unused-ignore]
    except ImportError as err:
        raise ConfigError("this pskv has no pskv.stream.Reader to read a job's change "
                          "stream from. Upgrade pskv, or call pskv.sinks.run_sink with a "
                          "store in your own program.") from err
    source: Source = Reader.from_env()
    return source


def _target(to: str, key: Any) -> tuple[str, str]:
    """``("file", DIR)`` or ``("redis", URL)`` of a ``--to``, checked without opening it."""
    if to.startswith("file:"):
        directory = to[len("file:"):]
        if directory.startswith("//"):      # file:///abs/dir
            directory = directory[2:]
        if not directory:
            raise ConfigError(f"--to {to!r} names no directory: write file:DIR, e.g. "
                              "file:serving/emb.", key=key)
        return "file", directory
    if to.startswith(("redis://", "rediss://")):
        parse_url(to)
        return "redis", to
    raise ConfigError(f"--to {to!r} is neither file:DIR nor redis://host:port/db. Write "
                      "e.g. --to file:serving/emb or --to redis://127.0.0.1:6379/0.", key=key)


def make_sink(to: str, key: Any, *, raw: bool = False, prefix: str = "pskv") -> Sink:
    """The sink ``--to`` names: ``file:DIR`` (:class:`FileSink`) or ``redis://...``
    (:class:`RedisSink`); ConfigError for anything else."""
    kind, where = _target(to, key)
    if kind == "file":
        return FileSink(where, key, raw=raw)
    return RedisSink(where, key, prefix, raw=raw)


def _key(text: str) -> int | str:
    """A table key as typed: a decimal integer is an int key, anything else a str key."""
    stripped = text.lstrip("-")
    return int(text) if stripped.isdigit() and stripped == stripped.strip() else text


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pskv.sinks``: feed a sink from a running job's table until SIGINT or
    SIGTERM. Returns the exit status (2: bad input; 1: the job or the sink failed)."""
    p = argparse.ArgumentParser(
        prog="python -m pskv.sinks",
        description="Write a pskv table's change stream where a serving stack reads it: "
                    "files (a full snapshot plus deltas and manifest.json) or Redis keys. "
                    "The job is found from the environment (pskv.stream.Reader.from_env).")
    p.add_argument("--key", required=True, help="the table key (a decimal number is an int "
                                                "key, anything else a str key)")
    p.add_argument("--to", required=True, metavar="file:DIR|redis://HOST:PORT/DB",
                   help="where to write: a directory, or a Redis URL "
                        "(redis://:PASSWORD@HOST:PORT/DB)")
    p.add_argument("--interval", type=float, default=0.2, metavar="SECONDS",
                   help="seconds between two polls (default 0.2)")
    p.add_argument("--raw", action="store_true",
                   help="write rows in the table's storage dtype (float16, bfloat16 bits) "
                        "instead of float32")
    p.add_argument("--prefix", default="pskv", help="the first part of each Redis key "
                                                    "(default pskv)")
    args = p.parse_args(argv)
    key = _key(args.key)
    if not args.key.strip():
        p.error("--key is empty: give the table key, e.g. --key emb")
    if not 0 <= args.interval <= 3600:
        p.error(f"--interval {args.interval:g}: give seconds in [0, 3600]")
    try:
        _target(args.to, key)                 # a bad target is bad input: exit 2
    except ConfigError as err:
        p.error(str(err))
    stop = threading.Event()
    try:
        source = _source()
        sink = make_sink(args.to, key, raw=args.raw, prefix=args.prefix)
    except ConfigError as err:
        print(f"python -m pskv.sinks: {err}", file=sys.stderr)
        return 2
    except KVStoreError as err:
        print(f"python -m pskv.sinks: {err}", file=sys.stderr)
        return 1
    old = signal.signal(signal.SIGTERM, lambda *_: stop.set()) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        wait_for_key(source, key, stop)
        run_sink(source, key, sink, interval=args.interval, stop=stop)
    except KeyboardInterrupt:
        return 130
    except KVStoreError as err:
        print(f"python -m pskv.sinks: {err}", file=sys.stderr)
        return 1
    finally:
        sink.close()
        close = getattr(source, "close", None)
        if callable(close):
            close()
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 0
