"""What the training examples print and plot: one format for all of them.

Invariants: an epoch line reads ``epoch E/N: loss L  test METRIC M  R samples/s  push/pull
S% of step time`` (epochs counted from 1); the final line reads ``rank R of W done: test
METRIC M, loss L, N epochs (K steps) in T s, R samples/s, push/pull S% of step time``.
Counts are printed with the right grammatical number ("1 epoch", "2 epochs").
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, Callable, TextIO

__all__ = ["Progress", "epoch_line", "make_figure", "plot_curves", "plural", "run_title",
           "summary_line"]

#: the clock progress lines are timed with (tests replace it)
_clock: Callable[[], float] = time.monotonic


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an ``s`` unless the count is 1.

    Examples
    --------
    >>> plural(1, "epoch"), plural(2, "worker"), plural(0, "step")
    ('1 epoch', '2 workers', '0 steps')
    """
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class Progress:
    """Progress through one epoch's batches on ``stream`` (default: stdout).

    On a terminal it is a tqdm bar, cleared when the epoch ends. On anything else (a
    pipe: pskv-launch forwards its workers' output a whole line at a time, so a bar that
    redraws one line with carriage returns would show only when the epoch ends), or where
    tqdm is not installed (an example that needs NumPy alone), it prints a plain line
    ``DESC: I/N batches (P%)`` at most every ``interval`` seconds.
    """

    def __init__(self, total: int, desc: str, enabled: bool = True,
                 stream: TextIO | None = None, interval: float = 1.0) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.done = 0
        self._stream = stream if stream is not None else sys.stdout
        self._bar: Any = None
        self._enabled = enabled and total > 0
        self._last = _clock()
        if self._enabled and self._stream.isatty():
            try:
                from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
            except ModuleNotFoundError:
                return                  # plain lines (the examples extra is not installed)
            self._bar = tqdm(total=total, desc=desc, unit="batch", leave=False, ncols=80,
                             mininterval=0.25, file=self._stream)

    def update(self, n: int = 1) -> None:
        """``n`` more batches are done."""
        self.done += n
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = _clock()
        if now - self._last >= self.interval and self.done < self.total:
            self._last = now
            print(f"{self.desc}: {self.done}/{self.total} batches "
                  f"({100 * self.done // self.total}%)", file=self._stream, flush=True)

    def close(self) -> None:
        """End the epoch's progress (the epoch line follows)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def epoch_line(epoch: int, epochs: int, loss: float, metric: str, value: float,
               samples_per_sec: float, comm_share: float) -> str:
    """One epoch's summary.

    Examples
    --------
    >>> epoch_line(1, 10, 0.25, "accuracy", 0.9, 12345.6, 0.4)
    'epoch 1/10: loss 0.2500  test accuracy 0.9000  12,346 samples/s  push/pull 40% of step time'
    """
    return (f"epoch {epoch}/{epochs}: loss {loss:.4f}  test {metric} {value:.4f}  "
            f"{samples_per_sec:,.0f} samples/s  push/pull {comm_share:.0%} of step time")


def summary_line(rank: int, num_workers: int, metric: str, value: float, loss: float,
                 epochs: int, steps: int, seconds: float, samples_per_sec: float,
                 comm_share: float, extra: Sequence[str] = ()) -> str:
    """The final line every worker prints; ``extra`` clauses go at its end.

    Examples
    --------
    >>> summary_line(0, 2, "accuracy", 0.97, 0.1, 1, 1, 2.0, 500.0, 0.5)
    'rank 0 of 2 done: test accuracy 0.9700, loss 0.1000, 1 epoch (1 step) in 2.0 s, 500 samples/s, push/pull 50% of step time'
    """
    parts = [f"rank {rank} of {num_workers} done: test {metric} {value:.4f}",
             f"loss {loss:.4f}",
             f"{plural(epochs, 'epoch')} ({plural(steps, 'step')}) in {seconds:.1f} s",
             f"{samples_per_sec:,.0f} samples/s",
             f"push/pull {comm_share:.0%} of step time", *extra]
    return ", ".join(parts)


def run_title(example: str, kv_type: str, num_workers: int, batch_size: int, lr: float,
              epochs: int) -> str:
    """The run's settings in one line (the plot's title).

    Examples
    --------
    >>> run_title("digits MLP", "dist_sync", 2, 32, 0.05, 1)
    'digits MLP: dist_sync, 2 workers, batch 32 per worker, lr 0.05, 1 epoch'
    """
    return (f"{example}: {kv_type}, {plural(num_workers, 'worker')}, batch {batch_size} per "
            f"worker, lr {lr:g}, {plural(epochs, 'epoch')}")


def make_figure(epochs: Sequence[int], losses: Sequence[float], metric: str,
                values: Sequence[float], title: str) -> Any:
    """Two panels, the loss and the test metric per epoch, under the title ``title``.

    The metric (an accuracy or an AUC) is drawn on its whole range, 0 to 1, so a run
    that has learned reads as one. Returns a matplotlib ``Figure`` on an Agg canvas: no
    GUI backend or global pyplot state is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8))
    FigureCanvasAgg(fig)
    ax_loss, ax_metric = fig.subplots(1, 2)
    ax_loss.plot(epochs, losses, marker="o")
    ax_loss.set(title="training loss", xlabel="epoch", ylabel="loss")
    ax_loss.set_ylim(bottom=0)
    ax_metric.plot(epochs, values, marker="o", color="tab:green")
    ax_metric.set(title=f"test {metric}", xlabel="epoch", ylabel=metric, ylim=(0.0, 1.0))
    for ax in (ax_loss, ax_metric):
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_curves(path: str, epochs: Sequence[int], losses: Sequence[float], metric: str,
                values: Sequence[float], title: str) -> None:
    """Save :func:`make_figure`'s figure to the image ``path``."""
    make_figure(epochs, losses, metric, values, title).savefig(path, dpi=100)
