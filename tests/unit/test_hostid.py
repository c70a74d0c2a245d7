"""Same host means "can reach my Unix socket" (issue #29, item 5): the host identity names
the boot and the network namespace, not only the hostname."""
from __future__ import annotations

import os
import socket

import pytest

from pskv._ps.hostid import host_id, same_host


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/net"), reason="no /proc/self/ns/net")
def test_the_host_identity_names_the_network_namespace_and_the_boot():
    ident = host_id()
    assert ident.startswith(socket.gethostname() + "/")
    assert f"netns={os.stat('/proc/self/ns/net').st_ino}" in ident.split("/")
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert "boot=" + f.read().strip() in ident.split("/")
    # the hostname alone (what a node of another namespace says) is another host
    assert same_host({"host": ident}) and not same_host({"host": socket.gethostname()})
    assert not same_host({})
