"""Run tests/durability/scripts/train.py under ``pskv-launch`` with the launcher named in
argv, a server SIGKILLed once (tests/durability/scripts/server.py); exit with its status.

Usage: ray_durable.py LAUNCHER OUT MAX_RESTARTS DIE_SERVER DIE_AFTER (DIE_SERVER -1: none).
"""
from __future__ import annotations

import sys
from pathlib import Path

from pskv.launch import launch

DURABLE = Path(__file__).resolve().parents[2] / "durability" / "scripts"


def main() -> int:
    launcher, out, restarts, die, after = sys.argv[1:6]
    Path(out).mkdir()
    env = {"PSKV_HEARTBEAT_TIMEOUT": "20", "PSKV_CONNECT_TIMEOUT": "30", "PSKV_REPLICAS": "1",
           "DIE_MARK": str(Path(out) / "died"), "DIE_SERVER": "" if die == "-1" else die,
           "DIE_AFTER": after}
    result = launch([sys.executable, str(DURABLE / "train.py"), out, "200", "dist_sync"], 2,
                    2, launcher=launcher, env=env, max_restarts=int(restarts), timeout=150,
                    server_command=[sys.executable, str(DURABLE / "server.py")])
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
