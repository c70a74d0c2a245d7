"""The Kubernetes client for the launcher's pod-settings tests, or None: pod settings are
checked by the client's models (docs/kubernetes.md), so those tests need it.

Imported with the test modules, not in a test: urllib3 probes for IPv6 with a socket on
import (tests/unit opens no socket inside a test)."""
from __future__ import annotations

import pytest

try:
    from kubernetes import client as k8s_client
except ImportError:
    k8s_client = None

HAVE_CLIENT = k8s_client is not None
#: a test that passes pod settings (flags, --values) through the client's models
needs_client = pytest.mark.skipif(not HAVE_CLIENT, reason="pod settings are checked by the "
                                  "Kubernetes client's models: pip install 'pskv[kubernetes]'")

__all__ = ["HAVE_CLIENT", "k8s_client", "needs_client"]
