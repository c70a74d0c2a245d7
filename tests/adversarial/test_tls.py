"""TLS between workers and servers (PSKV_TLS_CERT/KEY/CA): rounds work, strangers without
a certificate of the job's CA are refused at the handshake.

Certificates are made with the ``openssl`` command in a temporary directory.
"""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.config import ClusterConfig

from .conftest import frame

OPENSSL = shutil.which("openssl")


def make_ca(tmp: Path, name: str) -> tuple[str, str, str]:
    """A CA and one node certificate it signed: (cert, key, ca) PEM paths."""
    assert OPENSSL is not None

    def run(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        f"/CN={name}-ca", "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}-node",
        "-keyout", f"{name}.key", "-out", f"{name}.csr")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem", "-CAkey",
        f"{name}-ca.key", "-CAcreateserial", "-days", "2", "-out", f"{name}.pem")
    return str(tmp / f"{name}.pem"), str(tmp / f"{name}.key"), str(tmp / f"{name}-ca.pem")


@pytest.mark.timeout(90)
@pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command to make test "
                    "certificates: install OpenSSL (apt-get install openssl)")
def test_tls_rounds_and_strangers_refused(tmp_path: Path, thread_cluster: Any) -> None:
    tls = make_ca(tmp_path, "job")
    other = make_ca(tmp_path, "other")
    cluster = thread_cluster(2, 2, transport="tcp", tls=tls, bigarray_bound=1000)
    refused: dict[str, str] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((300_000,)))         # split over both servers, MiBs per push
        assert all(conn.tls for conn in kv._kv._conns), "the links are not TLS"
        if kv.rank == 0:
            host, _, port = kv._po.servers[0]["tcp"][4:].rpartition(":")
            # plain TCP to the TLS port: the handshake fails, the server goes on
            with socket.create_connection((host, int(port)), 5) as s:
                s.settimeout(3)
                s.sendall(frame(b'{"c": 1, "t": 1, "b": {"role": "worker", "rank": 0}}'))
                try:
                    refused["plain"] = repr(s.recv(100))
                except OSError as err:
                    refused["plain"] = repr(err)
            # a certificate of another CA
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=other[2])
            ctx.check_hostname = False
            ctx.load_cert_chain(other[0], other[1])
            try:
                with socket.create_connection((host, int(port)), 5) as raw, \
                        ctx.wrap_socket(raw) as s:
                    s.settimeout(3)
                    refused["other CA"] = repr(s.recv(100))
            except (ssl.SSLError, OSError) as err:
                refused["other CA"] = repr(err)
            go.set()
        else:
            go.wait(20)
        values = []
        for _ in range(3):
            kv.push(1, mx.nd.ones((300_000,)) * (kv.rank + 1))
            values.append(kv.pull(1).asnumpy())
        return values

    res = cluster.run(fn, timeout=60)
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        for value in res[rank]:
            np.testing.assert_array_equal(value, np.full(300_000, 3.0))
    assert refused["plain"] in ("b''",) or "Error" in refused["plain"], refused
    assert "b''" == refused["other CA"] or "Error" in refused["other CA"], refused
    assert all(c == 0 for c in cluster.join(15).values())


def test_tls_variables_go_together() -> None:
    env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "PSKV_TLS_CERT": "a.pem"}
    with pytest.raises(mx.errors.ConfigError, match="go together"):
        ClusterConfig.from_env(env, "worker")
    env.update(PSKV_TLS_KEY="a.key", PSKV_TLS_CA="ca.pem")
    assert ClusterConfig.from_env(env, "worker").tls == ("a.pem", "a.key", "ca.pem")
