"""What makes a client a PostgreSQL client, and which of its faces it has: no I/O.

A PostgreSQL client is known by what psycopg 3 and asyncpg have and no other
client (``sqlite3.Connection`` included) does: a psycopg connection's
``info`` beside ``execute``, a psycopg pool's ``getconn`` beside
``connection``, asyncpg's ``fetchrow`` beside ``fetch``, a SQLAlchemy
engine's ``dialect`` beside ``raw_connection`` (whichever database the
dialect names, unless another backend takes engines of that dialect:
``runners.py`` refuses all but PostgreSQL's, before any I/O).
"""

from __future__ import annotations

from ..shapes import defines

# Per PostgreSQL client kind: the two names that tell it, the first one the
# method whose face (coroutine function or not) tells sync from asyncio.
_SHAPES = (
    ("fetch", "fetchrow"),
    ("getconn", "connection"),
    ("execute", "info"),
    ("raw_connection", "dialect"),
)
DIALECTS = ("postgresql",)
"""The SQLAlchemy dialects whose engines are PostgreSQL clients."""


def postgres_method(client: object) -> str | None:
    """The method that tells a PostgreSQL client's face.

    ``fetch``, ``getconn``, ``execute`` or ``raw_connection`` (a coroutine
    function on SQLAlchemy's ``AsyncEngine``, a plain one on ``Engine``).

    None if ``client`` has none of the PostgreSQL shapes.
    """
    for name, beside in _SHAPES:
        if defines(client, name) and defines(client, beside):
            return name
    return None


def recognises(client: object) -> bool:
    """Whether ``client`` has one of the PostgreSQL shapes."""
    return postgres_method(client) is not None


def face(client: object, asynchronous: bool) -> str:
    """The method whose face tells sync from asyncio."""
    return postgres_method(client) or "execute"
