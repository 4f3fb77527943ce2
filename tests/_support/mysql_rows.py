"""A MySQL lock table seen from a plain connection, behind the libraries' backs.

- :func:`quoted`: a table or database name as MySQL quotes an identifier;
- :func:`fetch`: the rows one statement answers;
- :func:`rows`: what the table holds, key by key;
- :func:`ms`: a handle's expiry as epoch ms;
- :func:`age`: let a lease run out now, by the server's clock, without sleeping;
- :func:`server_ms`: the server's clock (:data:`NOW_MS`), as dmutex reads it;
- :class:`Counting`: a PyMySQL connection that records each statement it sends.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from pymysql.connections import Connection
from pymysql.cursors import Cursor

if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection  # generic in the stubs only

# The server's clock in epoch ms, as the store reads it (statements.py, rule 1), written
# out here rather than taken from the store, so that the tests check the store against it.
NOW_MS = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def quoted(name: str) -> str:
    """``name`` in backquotes, a backquote in it doubled."""
    return "`" + name.replace("`", "``") + "`"


def fetch(
    conn: _Connection, sql: str, args: tuple[object, ...] | None = None
) -> list[tuple[Any, ...]]:
    """The rows ``sql`` answers on ``conn`` (none for a statement that answers none)."""
    with conn.cursor() as cursor:
        cursor.execute(sql, args)
        return list(cursor.fetchall())


def rows(conn: _Connection, table: str, database: str | None = None) -> dict[str, tuple[str, int]]:
    """The table's rows: key -> (value, expired_at)."""
    named = quoted(table) if database is None else f"{quoted(database)}.{quoted(table)}"
    return {
        str(key): (str(value), int(expires))
        for key, value, expires in fetch(conn, f"SELECT `key`, `value`, `expired_at` FROM {named}")
    }


def ms(at: datetime) -> int:
    """A handle's ``expired_at`` as epoch ms."""
    return (at - EPOCH) // timedelta(milliseconds=1)


def age(raw: _Connection, table: str, key: str) -> None:
    """Let the lease in ``key``'s row run out: its expiry a second before now, on both clocks.

    A second, not a millisecond: the TypeScript store decides expiry by its
    host's clock, which is this machine's, read a moment apart from the server's.
    """
    with raw.cursor() as cursor:
        done = cursor.execute(
            f"UPDATE {quoted(table)} SET `expired_at` = {NOW_MS} - 1000 WHERE `key` = %s", (key,)
        )
    assert done == 1


def server_ms(conn: _Connection) -> int:
    """The server's clock in epoch ms, as dmutex reads it."""
    (now,) = fetch(conn, f"SELECT {NOW_MS}")[0]
    return int(now)


class Counting(_Connection):
    """A PyMySQL connection that records each query, COMMIT and ROLLBACK it sends.

    Each is one round trip: a command and the server's reply. ``cursor.execute``
    sends through :meth:`query`; ``commit()`` and ``rollback()`` send their own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[str] = []  # before connecting: an init_command is a query
        self.count = 0  # every one sent, never forgotten
        super().__init__(*args, **kwargs)

    def _note(self, text: str) -> None:
        self.sent.append(text)
        self.count += 1

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        self._note(sql.decode() if isinstance(sql, bytes) else str(sql))
        return super().query(sql, unbuffered)

    def commit(self) -> None:
        self._note("COMMIT")
        super().commit()

    def rollback(self) -> None:
        self._note("ROLLBACK")
        super().rollback()

    def taken(self) -> list[str]:
        """What was sent since the last call, each statement by its first word; then forgets it."""
        found = [text.split(None, 1)[0].upper() for text in self.sent]
        self.sent.clear()
        return found
