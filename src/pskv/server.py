"""``python -m pskv.server``: run the scheduler or a server, as ``DMLC_ROLE`` says."""
from __future__ import annotations

import logging
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Read the DMLC_* variables, run the node until the job ends, return its exit status."""
    from ._ps.config import ClusterConfig, Role
    from .errors import KVStoreError
    from .kvstore.server import run_node
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = ClusterConfig.from_env()
        if cfg.role == Role.WORKER:
            print("pskv.server runs the scheduler or a server; DMLC_ROLE=worker runs your "
                  "training script instead.", file=sys.stderr)
            return 2
        return run_node(cfg)
    except KVStoreError as err:
        print(f"pskv.server: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
