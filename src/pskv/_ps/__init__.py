"""ps-lite rebuilt in Python: private; every piece is an object, nothing is a singleton."""
from __future__ import annotations

__all__: list[str] = []
