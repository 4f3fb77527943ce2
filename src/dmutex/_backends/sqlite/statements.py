"""The SQL of one lock table, and the fence row's reads and writes (rules 2 and 7)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from ..._errors import DMutexError, InvalidArgumentError

# A connection to the lock file (the backend's, ``backend.py``).
Conn = sqlite3.Connection

# A fence row's expiry: the largest INTEGER, so that nothing takes it for a lease's.
FOREVER = 2**63 - 1


def quote(identifier: str) -> str:
    """An SQL identifier in double quotes; refuses what the TypeScript store refuses."""
    if not identifier or "\0" in identifier:
        raise InvalidArgumentError(
            f"an SQLite table name must be non-empty and without NUL bytes, not {identifier!r}"
        )
    if identifier[:7].lower() == "sqlite_":  # SQLite refuses them only at the first statement
        raise InvalidArgumentError(
            f"SQLite reserves table names that begin with 'sqlite_' (any case): {identifier!r}"
        )
    return '"' + identifier.replace('"', '""') + '"'


@dataclass(frozen=True, slots=True)
class Sql:
    """The statements of one table, with its quoted name filled in."""

    create_table: str
    create_index: str
    take: str
    slots: str
    read: str
    put: str
    delete: str
    delete_any: str
    extend: str
    extend_any: str
    insert: str
    update: str
    remove: str
    keys: str
    rows: str

    @classmethod
    def of(cls, table: str) -> Sql:
        t = quote(table)
        index = quote(f"{table}_expired_at_idx")
        # The names of slots 0 .. :permits - 1 of :key (the recursion stops there).
        # Parameters are named: numbered ones (?1) with a sequence warn on
        # Python 3.12.0-3.12.3, and 3.14 refuses them.
        names = (
            "WITH RECURSIVE slot(i) AS "
            "(SELECT 0 UNION ALL SELECT i + 1 FROM slot WHERE i + 1 < :permits) "
            "SELECT 'permit:' || i || ':' || :key FROM slot"
        )
        return cls(
            create_table=(
                f'CREATE TABLE IF NOT EXISTS {t} ("key" TEXT PRIMARY KEY, '
                '"value" TEXT NOT NULL, "expired_at" INTEGER NOT NULL)'
            ),
            create_index=f'CREATE INDEX IF NOT EXISTS {index} ON {t} ("expired_at")',
            # Rule 2. Inside DO UPDATE, a bare column is the stored row's.
            take=(
                f'INSERT INTO {t} ("key", "value", "expired_at") VALUES (:name, :token, :expires) '
                'ON CONFLICT("key") DO UPDATE SET "value" = excluded."value", '
                '"expired_at" = excluded."expired_at" '
                'WHERE "expired_at" <= :now OR "value" = :token'
            ),
            slots=(
                f'SELECT "key", "value", "expired_at" FROM {t} WHERE "key" IN ({names}) '
                'AND ("expired_at" > :now OR "value" = :token)'
            ),
            read=f'SELECT "value", "expired_at" FROM {t} WHERE "key" = :name',
            put=(
                f'INSERT INTO {t} ("key", "value", "expired_at") VALUES (:name, :token, :expires) '
                'ON CONFLICT("key") DO UPDATE SET "value" = excluded."value"'
            ),
            delete=(
                f'DELETE FROM {t} WHERE "key" = :name AND "value" = :token AND "expired_at" > :now'
            ),
            delete_any=(
                f'DELETE FROM {t} WHERE "key" IN ({names}) '
                'AND "value" = :token AND "expired_at" > :now'
            ),
            extend=(
                f'UPDATE {t} SET "expired_at" = :expires '
                'WHERE "key" = :name AND "value" = :token AND "expired_at" > :now'
            ),
            extend_any=(
                f'UPDATE {t} SET "expired_at" = :expires WHERE "key" IN ({names}) '
                'AND "value" = :token AND "expired_at" > :now'
            ),
            # A read-write lock's row (rule 7): written only over the value
            # the transaction read, and inserted only where none was.
            insert=(
                f'INSERT INTO {t} ("key", "value", "expired_at") VALUES (:name, :value, :expires)'
            ),
            update=(
                f'UPDATE {t} SET "value" = :value, "expired_at" = :expires '
                'WHERE "key" = :name AND "value" = :old'
            ),
            remove=f'DELETE FROM {t} WHERE "key" = :name AND "value" = :old',
            # Rule 9: the held keys of slots 0 .. :permits - 1, each once. The
            # slot is the text between "permit:" and the next ":", read as a
            # number only where it is one as dmutex writes it (no sign, no
            # leading zero); the key is what follows. A range of the primary
            # key ("permit;" follows every "permit:..." byte for byte).
            keys=(
                'SELECT DISTINCT substr(p."key", length(p.slot) + 9) AS k FROM '
                """(SELECT "key", substr("key", 8, instr(substr("key", 8), ':') - 1) AS slot """
                f"""FROM {t} WHERE "key" >= 'permit:' AND "key" < 'permit;' """
                'AND "expired_at" > :now) AS p '
                "WHERE CAST(CAST(p.slot AS INTEGER) AS TEXT) = p.slot "
                "AND CAST(p.slot AS INTEGER) BETWEEN 0 AND :permits - 1 "
                'AND length(p."key") > length(p.slot) + 8 '
                "ORDER BY k LIMIT :limit"
            ),
            # Rule 9: the read-write lock rows that may hold something, in key order.
            rows=(
                f"""SELECT "key", "value" FROM {t} WHERE "key" >= 'rwlock:' """
                """AND "key" < 'rwlock;' AND "expired_at" > :now """
                'ORDER BY "key"'
            ),
        )


def is_count(value: object) -> bool:
    """Whether ``value`` is a fence counter as dmutex writes it: ASCII decimal digits."""
    return isinstance(value, str) and value.isascii() and value.isdigit()


def slot_of(name: str, key: str) -> int:
    return int(name[len("permit:") : -len(key) - 1])


def creation(sql: Sql) -> Callable[[Conn], None]:
    """The call that creates a table and its expiry index if missing."""

    def create(conn: Conn) -> None:
        conn.execute(sql.create_table)
        conn.execute(sql.create_index)

    return create


def fence_counter(conn: Conn, sql: Sql, table: str, key: str) -> int:
    """The fence counter of ``key`` (0: no row yet); raise on a row dmutex did not write."""
    name = f"fence:{key}"
    row = conn.execute(sql.read, {"name": name}).fetchone()
    if row is None:
        return 0
    value, expires = row
    if not (is_count(value) and expires == FOREVER):
        raise DMutexError(f"the row {name!r} of table {table!r} holds a value dmutex did not write")
    return int(str(value))


def put_fence(conn: Conn, sql: Sql, key: str, fence: int) -> None:
    """Store ``fence`` as ``key``'s counter; the caller read the row (or its absence) first."""
    conn.execute(sql.put, {"name": f"fence:{key}", "token": str(fence), "expires": FOREVER})


def shown_fence(conn: Conn, sql: Sql, key: str) -> int | None:
    """``key``'s fence counter as an inspection shows it: None without a row of dmutex's."""
    counter = conn.execute(sql.read, {"name": f"fence:{key}"}).fetchone()
    return int(counter[0]) if counter and is_count(counter[0]) else None
