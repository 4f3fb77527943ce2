"""What the SQL backends share of a client's shape: a SQLAlchemy engine and its dialect."""

from __future__ import annotations

from ..shapes import defines

ASYNC_ENGINE = "sqlalchemy.ext.asyncio.AsyncEngine"
"""An engine's asyncio counterpart, as the error for a sync engine names it."""

SYNC_PACKAGES = ("sqlalchemy",)
"""SQLAlchemy's plain methods do their I/O before they return (outside its asyncio modules)."""


def is_engine(client: object) -> bool:
    """Whether ``client`` is shaped like a SQLAlchemy ``Engine`` or ``AsyncEngine``."""
    return defines(client, "raw_connection") and defines(client, "dialect")


def dialect_of(engine: object) -> object:
    """The name of an engine's dialect (an attribute, no I/O); None if it has none."""
    return getattr(getattr(engine, "dialect", None), "name", None)
