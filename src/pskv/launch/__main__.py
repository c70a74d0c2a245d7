"""``python -m pskv.launch``: the same as ``pskv-launch``."""
from __future__ import annotations

import sys

from . import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
