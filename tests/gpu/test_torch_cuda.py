"""pskv.torch with the model on CUDA gives the weights it gives on the CPU, to the bit
(two workers of an in-process dist_sync cluster): DistributedOptimizer (several buckets,
the communication thread, buffers; update_on_kvstore both ways), broadcast_parameters and
broadcast_optimizer_state.

The losses are linear in the outputs and the values small integers, so every gradient and
update is exact in float32 on either device: any difference is pskv's.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.testing import InprocCluster

from _gpu import MARKS, read, same_bits, torch

pytestmark = MARKS


class Net(torch.nn.Module if torch is not None else object):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: Any, y: Any) -> Any:
        return self.a(x).sum() + self.b(y).sum()


def train(kv: Any, device: str, update_on_kvstore: bool) -> list[np.ndarray]:
    import pskv.torch as pt
    rng = np.random.default_rng(11 + kv.rank)          # each worker starts elsewhere
    net = Net().to(device)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.from_numpy(rng.integers(-3, 4, tuple(p.shape)).astype(np.float32)))
    pt.broadcast_parameters(net.state_dict(), kv, prefix="init/")
    sgd = torch.optim.SGD(net.parameters(), lr=0.25, momentum=0.5)
    kw: dict[str, Any] = ({"update_on_kvstore": True, "kv_optimizer":
                           mx.optimizer.SGD(learning_rate=0.25, momentum=0.5)}
                          if update_on_kvstore else {"named_buffers": net.named_buffers()})
    opt = pt.DistributedOptimizer(None if update_on_kvstore else sgd, net.named_parameters(),
                                  kv, bucket_cap_mb=1e-5, **kw)
    data = np.random.default_rng(100 + kv.rank)
    for step in range(3):
        x = torch.from_numpy(data.integers(-2, 3, (5, 8)).astype(np.float32)).to(device)
        y = torch.from_numpy(data.integers(-2, 3, (5, 3)).astype(np.float32)).to(device)
        c = torch.from_numpy(data.integers(-2, 3, (5, 4)).astype(np.float32)).to(device)
        with torch.no_grad():
            net.seen.fill_(float(10 * kv.rank + step))
        opt.zero_grad()
        ((net.a(x) * c).sum() + net.b(y).sum()).backward()
        opt.step()
    out = [read(p) for p in net.parameters()]
    if not update_on_kvstore:       # the buffer is rank 0's, and so is the state
        out.append(read(net.seen))
        pt.broadcast_optimizer_state(sgd, kv, prefix="state/")
        out += [read(sgd.state[p]["momentum_buffer"]) for p in net.parameters()]
    opt.close()
    return out


@pytest.mark.parametrize("update_on_kvstore", [False, True])
def test_distributed_optimizer_on_cuda_gives_the_cpu_weights(update_on_kvstore: bool) -> None:
    pytest.importorskip("zmq", reason="the dist stores need pyzmq (pip install pyzmq)")
    torch.backends.cuda.matmul.allow_tf32 = False
    runs = {}
    for device in ("cpu", "cuda"):
        with InprocCluster(num_workers=2) as cluster:
            runs[device] = cluster.run(lambda kv: train(kv, device, update_on_kvstore),
                                       timeout=120)
        for rank, got in runs[device].items():
            assert not isinstance(got, BaseException), (device, rank, got)
    for rank in (0, 1):
        same_bits(runs["cuda"][rank], runs["cpu"][rank])
    same_bits(runs["cuda"][1], runs["cuda"][0])         # every worker holds the same


def test_parameters_on_two_devices_are_refused_by_name() -> None:
    import pskv.torch as pt
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net[1].to("cuda")
    kv = mx.kv.create("local")
    with pytest.raises(mx.errors.DeviceError, match=r"parameter '1.weight' is on cuda:0, but "
                                                    r"'0.weight' is on cpu"):
        pt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                net.named_parameters(), kv)


def test_train_torch_example_runs_on_cuda() -> None:
    pytest.importorskip(
        "sklearn", reason="the training example needs scikit-learn (the examples extra)")
    from pskv.examples import train_torch
    assert train_torch.main(["--device", "cuda", "--epochs", "1", "--quiet"]) in (0, None)
