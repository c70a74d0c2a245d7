"""TLS and PSKV_ENCRYPT benchmark: what mutual TLS (PSKV_TLS_CERT/KEY/CA) and the encryption
switch (PSKV_ENCRYPT=1: every message sealed with AES-256-GCM) cost on the worker-server TCP
link.

Run from the repository root::

    python benchmarks/bench_tls.py            # full run, a few minutes on 2 cores
    python benchmarks/bench_tls.py --quick    # smoke run, under a minute

One small job per setting, as threads of this process (a scheduler, one server, one
``dist_sync`` worker) on 127.0.0.1 with ``PSKV_TRANSPORT=tcp``: the same TCP stream path a
worker on another host takes, plain, over TLS (certificates made with the ``openssl``
command in a temporary directory) and sealed (``PSKV_ENCRYPT=1``). Figures: microseconds
per push+pull of a small key, and MB/s per push+pull of dense float32 keys. The three jobs
alternate per size, so machine load falls on all alike. Results go to ``benchmarks/results/bench_tls.{json,md}``.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import _common

import pskv as mx
from pskv._ps.config import ClusterConfig, Role
from pskv.kvstore.dist import DistKVStore
from pskv.launch._net import free_port
from pskv.server import run_node

HEAD = ["key", "plain TCP", "TLS", "PSKV_ENCRYPT=1", "TLS / plain", "ENCRYPT / plain"]
#: dense sizes in float32 elements: 4 KB, 4 MB, 64 MB
SIZES = {1024: "4 KB", 1048576: "4 MB", 16777216: "64 MB"}


def make_certs(tmp: Path) -> tuple[str, str, str]:
    """A throwaway CA and one node certificate: (cert, key, ca) PEM paths."""
    openssl = shutil.which("openssl")
    if openssl is None:
        sys.exit("bench_tls.py needs the openssl command to make certificates "
                 "(apt-get install openssl)")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node", "-keyout", "node.key",
        "-out", "node.csr")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-out", "node.pem")
    return str(tmp / "node.pem"), str(tmp / "node.key"), str(tmp / "ca.pem")


def job(tls: tuple[str, str, str] | None, size: int, iters: int,
        encrypt: bool = False) -> list[float]:
    """Seconds per push+pull of a ``size``-element key, one sample per iteration."""
    cfg = ClusterConfig(role=Role.WORKER, root_port=free_port(), transport="tcp",
                        secret=b"bench", tls=tls, connect_timeout=30, request_timeout=60,
                        coalesce_bytes=0, encrypt=encrypt)
    stop = threading.Event()
    nodes = [threading.Thread(target=run_node, args=(cfg.with_role(role), stop), daemon=True)
             for role in (Role.SCHEDULER, Role.SERVER)]
    for t in nodes:
        t.start()
    kv = DistKVStore("dist_sync", cfg)
    try:
        return _common.push_pull_samples(kv, mx.nd, size, iters, warmup=2)
    finally:
        kv.close()
        for t in nodes:
            t.join(30)
        stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    sizes = {16: "64 B", **{k: v for k, v in SIZES.items() if not args.quick or k <= 1048576}}
    rows, data = [], {"machine": _common.machine_info(), "commit": _common.commit_info(),
                      "command": _common.command_line(argv), "when": _common.timestamp(),
                      "results": {}}
    with tempfile.TemporaryDirectory(prefix="pskv-bench-tls-") as tmp:
        certs = make_certs(Path(tmp))
        for size, label in sizes.items():
            iters = 20 if args.quick else (200 if size <= 1024 else 30)
            plain = statistics.median(job(None, size, iters))
            tls = statistics.median(job(certs, size, iters))
            sealed = statistics.median(job(None, size, iters, encrypt=True))
            mb = size * 4 / 1e6
            entry = {"plain_s": plain, "tls_s": tls, "slowdown": tls / plain,
                     "encrypt_s": sealed, "encrypt_slowdown": sealed / plain}
            data["results"][label] = entry
            cells = [f"{s * 1e6:.0f} us" if size <= 1024 else f"{mb / s:.0f} MB/s"
                     for s in (plain, tls, sealed)]
            rows.append([label, *cells, f"{tls / plain:.2f}x", f"{sealed / plain:.2f}x"])
            print(_common.text_table(HEAD, rows[-1:]), flush=True)
    md = ("# TLS and PSKV_ENCRYPT cost on the worker-server TCP link\n\n" + _common.md_table(
        HEAD, rows) +
        f"\n\nMachine: {data['machine'].get('cpu_model')}, {data['machine'].get('cpu_count')} "
        f"cores, Python {data['machine'].get('python')}; commit {data['commit']['commit']}, "
        f"{data['when']}. Medians; `{data['command']}`\n")
    if not args.quick:
        _common.write_results("bench_tls", data, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
