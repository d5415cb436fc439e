"""Kiln's hand-written CPU kernels, built at install time (see build.py)."""
