"""The ray launcher's connection rules, with a stand-in for the ray module (no Ray, no
sockets). The real local Ray test is tests/dist/test_launch_ray.py."""
from __future__ import annotations

import builtins
from typing import Any

import pytest

from pskv.errors import ConfigError
from pskv.launch import LaunchSpec, parse_args
from pskv.launch._ray import LOCAL_OBJECT_STORE_BYTES, _connect, run_ray


class FakeRay:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.inits: list[dict[str, Any]] = []
        self.fail = fail

    def init(self, **kwargs: Any) -> None:
        self.inits.append(kwargs)
        if self.fail is not None:
            raise self.fail


def test_ray_address_connects_there() -> None:
    ray = FakeRay()
    assert _connect(ray, {"RAY_ADDRESS": "10.0.0.1:6379"}) is False
    assert ray.inits[0]["address"] == "10.0.0.1:6379"
    assert "num_cpus" not in ray.inits[0]  # an existing cluster: nothing to size


def test_without_ray_address_starts_a_small_local_cluster() -> None:
    ray = FakeRay()
    assert _connect(ray, {}) is True
    kw = ray.inits[0]
    assert "address" not in kw
    assert kw["include_dashboard"] is False
    assert kw["object_store_memory"] == LOCAL_OBJECT_STORE_BYTES


def test_an_unreachable_cluster_is_a_config_error() -> None:
    ray = FakeRay(ConnectionError("no GCS"))
    with pytest.raises(ConfigError, match="RAY_ADDRESS=nowhere:1.*ray status"):
        _connect(ray, {"RAY_ADDRESS": "nowhere:1"})


def test_missing_ray_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_ray(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"pskv\[ray\]"):
        run_ray(LaunchSpec(("x",), 1, launcher="ray"), environ={})


def test_flags() -> None:
    spec = parse_args(["--launcher", "ray", "-n", "3", "-s", "1", "python", "t.py"],
                      environ={})
    assert (spec.launcher, spec.num_workers, spec.num_servers) == ("ray", 3, 1)
    with pytest.raises(ConfigError, match="from the cluster manager"):
        LaunchSpec(("x",), 1, launcher="ray", hosts="a:1,b:1")
