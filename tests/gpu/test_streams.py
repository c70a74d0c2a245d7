"""Stream semantics (docs/gpu.md): a push reads a tensor after the work queued on the
caller's current stream; what a pull writes is there for the next kernel on that stream
when the call returns; a pinned buffer is not written again while a copy from it waits."""
from __future__ import annotations

import numpy as np

import pskv as mx

from _gpu import MARKS, read, torch

pytestmark = MARKS

N = 1 << 20


def _busy(stream: object) -> None:
    """Keep the current stream busy for a while (the copies queued next wait for it)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(200_000_000)           # about 0.1 s of GPU cycles
        return
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        a = a @ a / 2048


def test_push_reads_after_the_kernel_on_a_side_stream() -> None:
    kv = mx.kv.create("local")
    kv.init(0, np.zeros(N, np.float32))
    x = torch.zeros(N, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _busy(side)
        x.fill_(3.0)                 # queued behind the busy kernel
        kv.push(0, x)                # must read the 3s, not the zeros
    np.testing.assert_array_equal(kv.pull(0), np.full(N, 3.0, np.float32))


def test_device_store_gpu_sum_reads_after_the_side_stream_too() -> None:
    kv = mx.kv.create("device")
    kv.init(0, np.zeros(N, np.float32))
    xs = [torch.zeros(N, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _busy(side)
        for i, x in enumerate(xs):
            x.fill_(float(i + 1))
        kv.push(0, xs)
    np.testing.assert_array_equal(kv.pull(0), np.full(N, 3.0, np.float32))


def test_pull_result_is_seen_by_the_next_kernel_on_the_current_stream() -> None:
    kv = mx.kv.create("local")
    kv.init(["a", "b"], [np.full(N, 5.0, np.float32), np.full(N, 7.0, np.float32)])
    out_a = torch.zeros(N, device="cuda")
    out_b = torch.zeros(N, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _busy(side)                  # the copies into out_a wait behind this
        kv.pull("a", out=out_a)
        doubled = out_a * 2          # a kernel right after the call, same stream
        # the same pinned buffer (shape, dtype) again: it must wait for out_a's copy
        kv.pull("b", out=out_b)
        tripled = out_b * 3
    side.synchronize()
    np.testing.assert_array_equal(read(doubled), np.full(N, 10.0, np.float32))
    np.testing.assert_array_equal(read(out_a), np.full(N, 5.0, np.float32))
    np.testing.assert_array_equal(read(tripled), np.full(N, 21.0, np.float32))
