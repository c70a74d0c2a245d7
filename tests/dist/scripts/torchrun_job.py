"""A script torchrun starts (tests/dist/test_torchrun.py): a dist_sync pushpull and one
pskv.torch DistributedOptimizer step, checked; prints one JSON line per worker and the
pids of the pskv nodes this process started."""
from __future__ import annotations

import json
import os

import torch

import pskv as mx
import pskv.torch as pt

try:   # the pskv nodes this process started (absent before torchrun support)
    from pskv.kvstore.dist._torchrun import _children
except ImportError:
    _children = []

with mx.kv.create("dist_sync") as kv:
    rank, n = kv.rank, kv.num_workers
    assert rank == int(os.environ["RANK"]) and n == int(os.environ["WORLD_SIZE"])
    kv.init("w", mx.nd.zeros((4,)))
    out = mx.nd.zeros((4,))
    kv.pushpull("w", mx.nd.ones((4,)) * (rank + 1), out=out)
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                  model.named_parameters(), kv)
    opt.zero_grad()
    model.weight.grad = torch.full((1, 2), float(rank + 1))
    opt.step()                           # averaged: -lr * mean(1..n)
    print(json.dumps({"rank": rank, "n": n, "sum": float(out.asnumpy()[0]),
                      "weight": model.weight.detach().tolist()[0],
                      "nodes": [p.pid for p in _children]}), flush=True)
