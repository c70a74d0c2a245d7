"""Runnable training examples: ``python -m pskv.examples.<name>`` (see the README).

Nothing here is imported by ``import pskv``; each example imports what it needs.
"""
from __future__ import annotations

__all__: list[str] = []
