"""pytest's settings for the docstring examples under src/pskv (tests/conftest.py serves tests/).

torch is an optional dependency (``pip install -e '.[torch]'``), and the README's test
command installs only the test extras: without torch, ``src/pskv/torch/_embedding.py``
(torch ``nn.Module`` classes, so it imports torch) is not collected, the other pskv.torch
docstring examples are skipped with the reason below, and the header of the run says so. The
torch tests under tests/ skip themselves (``pytest.importorskip``) with the same advice.
Likewise the kubernetes client (``pip install -e '.[kubernetes]'``): the docstring examples
that read pod settings (checked by its models) are skipped without it.
"""
from __future__ import annotations

import importlib.util

import pytest

#: the advice every torch skip gives
TORCH_MISSING = ("torch is not installed: pip install -e '.[torch]' (on these machines "
                 "pip install torch==2.13.0 first, for the CPU wheel) to run the torch tests")

KUBERNETES_MISSING = ("the Kubernetes client is not installed: pip install -e '.[kubernetes]' "
                      "(pod settings are checked by its models)")
#: docstring examples that need the client
KUBERNETES_DOCTESTS = ("pskv.launch._k8s_options.pod_options",)


def _torch_missing() -> bool:
    # find_spec answers without importing torch (seconds): None when it is not installed
    # (or when a test hid it with sys.modules['torch'] = None)
    return importlib.util.find_spec("torch") is None


#: modules pytest must not import at all without torch (they import it at module level)
collect_ignore = ["src/pskv/torch/_embedding.py"] if _torch_missing() else []


def pytest_report_header(config: pytest.Config) -> str | None:
    return TORCH_MISSING if _torch_missing() else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_kubernetes = importlib.util.find_spec("kubernetes") is None
    for item in items:
        if not isinstance(item, pytest.DoctestItem):
            continue
        if _torch_missing() and item.name.startswith("pskv.torch."):
            item.add_marker(pytest.mark.skip(reason=TORCH_MISSING))
        if no_kubernetes and item.name in KUBERNETES_DOCTESTS:
            item.add_marker(pytest.mark.skip(reason=KUBERNETES_MISSING))
