"""The package version: the one place it is written (``pyproject.toml`` reads it)."""

__version__ = "0.1.0"
"""This release's version, as ``pyproject.toml`` and the wheel give it."""
