"""``python -m pskv.sinks``: see :func:`pskv.sinks.main`."""
from __future__ import annotations

from ._run import main

if __name__ == "__main__":
    raise SystemExit(main())
