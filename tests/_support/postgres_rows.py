"""A PostgreSQL lock table seen from a plain connection, behind the libraries' backs.

- :func:`rows`: what the table holds, key by key;
- :func:`ms`: a stored expiry as dmutex reads it;
- :func:`age`: let a lease run out now, by the server's clock, without sleeping.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg


def rows(raw: psycopg.Connection[Any], table: str) -> dict[str, tuple[str, datetime]]:
    """The table's rows: key -> (value, expired_at)."""
    found = raw.execute(f'SELECT "key", "value", "expired_at" FROM "{table}"').fetchall()
    return {key: (value, at) for key, value, at in found}


def ms(at: datetime) -> int:
    """A timestamptz as epoch ms, rounded down, as the store reads it."""
    return int(at.timestamp() * 1_000_000) // 1000


def age(raw: psycopg.Connection[Any], table: str, key: str) -> None:
    """Let the lease in ``key``'s row run out: its expiry a millisecond before the server's now."""
    done = raw.execute(
        f"""UPDATE "{table}" SET "expired_at" = statement_timestamp() - interval '1 ms'
        WHERE "key" = %s""",
        (key,),
    )
    assert done.rowcount == 1
