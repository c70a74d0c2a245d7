"""Attacks on a node (see conftest.py)."""
