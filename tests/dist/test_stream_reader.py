"""A standalone reader of the change stream (``pskv.stream.Reader``) in a real job: it takes
no worker slot, mirrors the tables bit for bit, and may read and nothing else."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pskv.launch import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "stream_job.py"


@pytest.mark.parametrize("servers", [1, 2])
def test_a_reader_mirrors_the_servers_and_may_only_read(tmp_path: Path, servers: int) -> None:
    result = launch([sys.executable, str(SCRIPT), str(tmp_path), "40"], 2, servers,
                    env={"PSKV_CONNECT_TIMEOUT": "30"}, timeout=200)
    assert result.returncode == 0
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["same"] and got["rows"] == got["stats_rows"] > 0
    assert got["reader_versions"] == got["versions"] == got["mirror_versions"]
    assert len(got["refused"]) == 2
    assert all(r.startswith("ProtocolError") and "reader" in r for r in got["refused"]), got


def test_a_reader_without_the_jobs_secret_is_refused(tmp_path: Path) -> None:
    """The scheduler challenges a reader like any node: no secret, or another one, gets
    no server address and no reader key."""
    import textwrap
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, json
        import pskv as mx
        from pskv.errors import KVStoreError
        from pskv.stream import Reader
        kv = mx.kv.create('dist_sync')
        out = []
        if kv.rank == 0:
            for secret in (None, 'not-the-secret'):
                env = dict(os.environ)
                env.pop('PSKV_SECRET', None)
                if secret:
                    env['PSKV_SECRET'] = secret
                try:
                    Reader.from_env(env, timeout=3).close()
                    out.append('admitted')
                except KVStoreError as err:
                    out.append(type(err).__name__ + ': ' + str(err))
            json.dump(out, open(sys.argv[1], 'w'))
        kv.barrier()
        kv.close()
    """))
    result = launch([sys.executable, str(script), str(tmp_path / "out.json")], 1, 1,
                    env={"PSKV_CONNECT_TIMEOUT": "30"}, timeout=120)
    assert result.returncode == 0
    got = json.loads((tmp_path / "out.json").read_text())
    assert len(got) == 2 and "admitted" not in got, got
    assert "PSKV_SECRET is not set" in got[0], got
