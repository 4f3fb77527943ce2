"""The SQL of the PostgreSQL store, one builder per statement, for one table.

They sit in ``dmutex._backends.postgresql`` beside the store that runs them
(``store.py``); tests and benchmarks import them from here.

Rules of the statements:

1. Time is the server's, read as ``statement_timestamp()``: the moment the
   statement reached the server, the same wherever the statement reads it.
   ``now()`` is the start of the *transaction*: in autocommit (one statement,
   one transaction) the two are equal or microseconds apart (below), but a
   statement sent on a connection that is not in autocommit runs after a
   ``BEGIN``, and then ``now()`` is earlier, so a lease would get less than
   its TTL and an expiry test would look into the past.
   ``clock_timestamp()`` moves while the statement runs, so the expiry a
   row is compared with and the one stored beside it would disagree. The
   TypeScript store's ``NOW()`` is its autocommit statement's transaction
   start: node-postgres sends a statement with values as Parse, Bind and
   Execute at once, so that is the Parse's moment, microseconds before the
   Execute's ``statement_timestamp()``. The two libraries judge a row by
   one clock, read microseconds apart.
2. Every operation is one statement: the grant, its fence, and what a
   waiter learns of the lease in the way are common table expressions of
   the acquire's one statement; release, extend, a batch of renewals,
   the holders of a key and the table's held keys (``keys``, with a
   ``LIMIT``) are one statement each. No statement needs a
   transaction around it, a session setting, an advisory lock or a named
   prepared statement, so any pooler (PgBouncer in transaction mode) may
   hand each one to another server connection.
3. A slot is taken by an upsert whose ``DO UPDATE`` applies only to a row
   that has expired or already holds the caller's token (a re-sent copy of
   an acquire whose reply was lost), and PostgreSQL evaluates that
   condition on the row's latest version, under its row lock: a held row is
   never overwritten, however many acquires race for it.
4. The fence counter is the row ``fence:{key}``, its value the counter in
   decimal, its ``expired_at`` :data:`FOREVER` so that nothing takes it for a
   lease (an expiry sweep by ``expired_at`` never reaches it). Not
   ``'infinity'``: psycopg cannot load that into a ``datetime``, so a
   ``SELECT *`` of the table from Python would fail; the start of the year
   9999 is a ``datetime`` in every time zone. The grant's
   statement creates it if absent and moves it on
   (``dmutex._core.fences``, rule 1) only if it holds dmutex's kind of value;
   a row of that key that dmutex did not write makes the statement fail (a
   cast of the message :data:`FOREIGN` names) before anything is committed.
5. Epoch milliseconds are taken from ``timestamptz`` rounded down, so an
   expiry the store reports is never later than the one the server holds.
6. Parameters are named, ``%(name)s`` (psycopg's style) in the text written
   here; :class:`Statement` also carries asyncpg's ``$n`` form and the order
   of its arguments. That conversion is the one place where the drivers'
   styles differ.
7. A release notifies only when someone may wait, in its own statement:
   ``pg_notify(channel, key)`` in the ``SELECT`` over the ``DELETE``'s
   returned rows, so at most once for each row it removed, never when it
   removed none (an expired lease, another's token), and only while the
   key's waiters mark is active: the row ``waiters:{key}``, value
   :data:`WAITERS`, which a failed attempt of a listening waiter writes in
   its own statement (``%(waiting)s`` ms from now, 0: none), so that no
   release after it misses the waiter. A row of that key with another
   value is never written nor heeded (its waiters poll). The notification
   leaves with the commit, as the deletion does. The channel is one per
   table (:func:`channel`), the payload the lock's key (at most
   ``MAX_KEY_LENGTH`` characters, far below the payload's limit of 8000
   bytes), so a listener of one table never hears another's. Why only
   then: a transaction that notified takes PostgreSQL's notification
   queue lock at commit, which serializes notifying commits cluster-wide
   (``benchmarks/postgres_handoff.py``, fsync off, a loaded 2-core host:
   4 threads cycling on their own keys made 6-18% fewer cycles when every
   release notified than with the bare DELETE). Open question: on that
   host the mark's read measured no cheaper than always notifying; to be
   measured again on a quiet machine. Expiry notifies nobody: a waiter's
   wait already ends when the lease in its way expires (``waiting.py``,
   rule 2; the acquire reports that expiry).
8. A semaphore's acquire names its number of permits in its text
   (:meth:`Statements.acquire_semaphore_of`), not as a parameter, so that
   the plan PostgreSQL caches for a prepared statement (asyncpg prepares
   every statement, psycopg from its fifth run) knows how many slots it
   reads. With ``generate_series(0, $n - 1)`` a generic plan counts on
   1,000 slots, so the server kept planning the statement afresh at every
   run (0 generic plans in 13 runs, 0.185 ms of planning a run against the
   mutex's 0.005 ms, against a 0.07 ms execution); with the number written
   in, it takes the generic plan as the mutex's does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..._errors import InvalidArgumentError

__all__ = [
    "COLUMNS",
    "FOREIGN",
    "FOREVER",
    "PRIMARY_KEY",
    "WAITERS",
    "Statement",
    "Statements",
    "channel",
    "qualified",
    "quote",
]

# How the store recognises the failure of a grant that met a fence row it did
# not write: the text of the cast that fails (rule 4).
FOREIGN = "holds a value dmutex did not write"

# The table's shape as ready() reads it back from the catalog: each column as
# "name type [NOT NULL]" in order (format_type's spelling), and the key columns.
COLUMNS = "key text NOT NULL, value text NOT NULL, expired_at timestamp with time zone NOT NULL"
PRIMARY_KEY = "key"

# The value of a key's waiters mark (rule 7).
WAITERS = "dmutex-waiters"
# The lock's key of a released slot's row (rule 7).
_KEY_OF_ROW = "regexp_replace(gone.\"key\", '^permit:[0-9]+:', '')"
# A fence row's expiry (rule 4).
FOREVER = "9999-01-01 00:00:00+00"
_FOREVER = f"'{FOREVER}'::timestamptz"
_NOW = "statement_timestamp()"
# The latest expiry dmutex reads as a number: lease.MAX_EXPIRY_MS. Beyond it
# (a row another program wrote, 'infinity'), an expiry reads as this.
_LAST = "'9999-12-31 23:59:59+00'::timestamptz"
_EXPIRY = f"{_NOW} + %(ttl)s::bigint * interval '1 millisecond'"
_NOW_US = f"floor(extract(epoch FROM {_NOW}) * 1000000)::bigint"
# A counter value dmutex writes: decimal digits that fit a bigint plus one.
_COUNT = "'^[0-9]{1,18}$'"
_PARAM = re.compile(r"%\((\w+)\)s|%%")


def _ms(timestamp: str) -> str:
    """SQL for ``timestamp`` in whole epoch milliseconds, rounded down (rule 5)."""
    return f"floor(extract(epoch FROM least({timestamp}, {_LAST})) * 1000)::bigint"


def quote(identifier: str, what: str = "table_name") -> str:
    """An identifier in double quotes, as the TypeScript store quotes it, refusing what it does."""
    if not isinstance(identifier, str) or not identifier or "\0" in identifier:
        raise InvalidArgumentError(
            f"a PostgreSQL {what} must be a non-empty string without NUL bytes, not {identifier!r}"
        )
    return '"' + identifier.replace('"', '""') + '"'


def qualified(table: str, schema: str | None) -> str:
    """The table as statements name it: ``"schema"."table"``, or ``"table"`` on the search path."""
    name = quote(table)
    return name if schema is None else f"{quote(schema, 'schema_name')}.{name}"


# A channel name is an identifier: at most NAMEDATALEN - 1 bytes.
_CHANNEL_BYTES = 63


def channel(table: str) -> str:
    """The notification channel of the table ``qualified()`` names: ``dmutex "schema"."table"``.

    That text itself while it fits an identifier (63 bytes), else
    ``dmutex `` and the first 56 hex digits of its SHA-256: the two forms
    never meet, since a qualified name begins with a double quote. A table
    named without a schema is one channel wherever the search path finds
    it: two such tables of one name in two schemas wake each other's
    waiters, which then try and wait again (a signal is a hint).
    """
    named = f"dmutex {table}"
    if len(named.encode()) <= _CHANNEL_BYTES:
        return named
    return "dmutex " + hashlib.sha256(table.encode()).hexdigest()[: _CHANNEL_BYTES - 7]


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement's text for each placeholder style, and its parameters' names.

    ``psycopg`` takes a mapping of the names; ``asyncpg`` takes the values
    positionally in the order of ``names`` (rule 6).
    """

    psycopg: str
    asyncpg: str
    names: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> Statement:
        """The statement written as ``text`` with ``%(name)s`` placeholders."""
        names: list[str] = []

        def number(found: re.Match[str]) -> str:
            if found[1] is None:
                return "%"  # psycopg's escaped percent sign
            if found[1] not in names:
                names.append(found[1])
            return f"${names.index(found[1]) + 1}"

        return cls(text, _PARAM.sub(number, text), tuple(names))

    def arguments(self, params: Mapping[str, object]) -> tuple[object, ...]:
        """``params`` in asyncpg's order."""
        return tuple(params[name] for name in self.names)


def _names(first: str, last: str) -> str:
    """SQL for the rows ``(i, name)`` of slots ``first .. last`` of ``%(key)s``."""
    return (
        "SELECT s.i, 'permit:' || s.i || ':' || %(key)s::text AS name "
        f"FROM generate_series({first}, {last}) AS s(i)"
    )


# Slots %(first)s .. %(last)s of %(key)s as an array: an index scan whatever the
# planner guesses of their number.
_SLOT_ARRAY = f"ARRAY(SELECT name FROM ({_names('%(first)s::int', '%(last)s::int')}) AS n)"


@dataclass(frozen=True, slots=True)
class Statements:
    """Every statement of one table (``schema_name`` optional), fence or none.

    The acquires answer one row: ``slot`` (NULL unless granted), its
    expiry in ms, the fence (NULL without one), the earliest expiry of an
    active lease held by another token (NULL if none), the server's time in
    ms, and ``raced``: a slot looked free when the statement began but
    another caller took it first (a semaphore only; rule 3).
    """

    table: str
    index_name: str
    channel: str
    fencing: bool
    shape: Statement
    create_table: Statement
    create_index: Statement
    acquire_mutex: Statement
    acquire_semaphore: Statement
    release: Statement
    extend: Statement
    extend_many: Statement
    holders: Statement
    keys: Statement
    mark: Statement
    listen: Statement
    unlisten: Statement

    @classmethod
    def of(cls, table: str, schema: str | None = None, *, fencing: bool = True) -> Statements:
        """The statements of ``table`` in ``schema`` (None: the search path)."""
        named = qualified(table, schema)
        # Identifiers may hold "%", which psycopg would read as a placeholder.
        t = _escape(named)
        index = f"{table}_expired_at_idx"
        heard = channel(named)
        return cls(
            table=named,
            index_name=index,
            channel=heard,
            fencing=fencing,
            shape=Statement.of(_SHAPE),
            create_table=Statement.of(
                f"CREATE TABLE IF NOT EXISTS {t} (\n"
                '  "key" text PRIMARY KEY,\n'
                '  "value" text NOT NULL,\n'
                '  "expired_at" timestamptz NOT NULL\n'
                ")"
            ),
            create_index=Statement.of(
                f'CREATE INDEX IF NOT EXISTS {_escape(quote(index))}\nON {t} ("expired_at")'
            ),
            acquire_mutex=Statement.of(_acquire(t, fencing, semaphore=False)),
            acquire_semaphore=Statement.of(_acquire(t, fencing, semaphore=True)),
            release=Statement.of(
                f'WITH gone AS (DELETE FROM {t}\nWHERE "key" = ANY({_SLOT_ARRAY})\n'
                f'  AND "value" = %(token)s::text AND "expired_at" > {_NOW}\n'
                'RETURNING "key")\n'
                # The lock's key, read back from the row's (rule 7).
                'SELECT "key", CASE WHEN EXISTS (SELECT 1 FROM '
                f"{t} AS w\n"
                f"  WHERE w.\"key\" = 'waiters:' || {_KEY_OF_ROW}\n"
                f'    AND w."value" = \'{WAITERS}\' AND w."expired_at" > {_NOW})\n'
                f"  THEN pg_notify('{_escape(_in_literal(heard))}', {_KEY_OF_ROW}) END\n"
                "FROM gone"
            ),
            extend=Statement.of(
                f'UPDATE {t} SET "expired_at" = {_EXPIRY}\n'
                f'WHERE "key" = ANY({_SLOT_ARRAY})\n'
                f'  AND "value" = %(token)s::text AND "expired_at" > {_NOW}\n'
                "RETURNING " + _ms('"expired_at"')
            ),
            extend_many=Statement.of(
                "WITH asked AS (\n"
                "  SELECT * FROM unnest(%(names)s::text[], %(tokens)s::text[],\n"
                "    %(ttls)s::bigint[])\n"
                "    WITH ORDINALITY AS a(name, token, ttl, n)\n"
                ")\n"
                f"UPDATE {t} AS t\n"
                f"SET \"expired_at\" = {_NOW} + asked.ttl * interval '1 millisecond'\n"
                "FROM asked\n"
                'WHERE t."key" = asked.name AND t."value" = asked.token\n'
                f'  AND t."expired_at" > {_NOW}\n'
                f"RETURNING asked.n, {_ms('t.expired_at')}"
            ),
            # Rule 7's mark alone, for an observer (an election's watch) that
            # makes no attempt: the release after it notifies.
            mark=Statement.of(
                f'INSERT INTO {t} AS t ("key", "value", "expired_at")\n'
                f"VALUES ('waiters:' || %(key)s::text, '{WAITERS}',\n"
                f"  {_NOW} + %(waiting)s::bigint * interval '1 millisecond')\n"
                'ON CONFLICT ("key") DO UPDATE\n'
                'SET "expired_at" = greatest(t."expired_at", EXCLUDED."expired_at")\n'
                f"WHERE t.\"value\" = '{WAITERS}'"
            ),
            holders=Statement.of(
                f"WITH slot AS ({_names('0', '%(permits)s::int - 1')})\n"
                f'SELECT NULL::int, f."value", NULL::bigint, {_ms(_NOW)}\n'
                f"FROM (SELECT 1) AS one LEFT JOIN {t} AS f\n"
                "  ON f.\"key\" = 'fence:' || %(key)s::text\n"
                f'  AND f."expired_at" = {_FOREVER} AND f."value" ~ {_COUNT}\n'
                "UNION ALL\n"
                f'SELECT slot.i, t."value", {_ms("t.expired_at")}, {_ms(_NOW)}\n'
                f'FROM slot JOIN {t} AS t ON t."key" = slot.name\n'
                f'WHERE t."expired_at" > {_NOW}'
            ),
            keys=Statement.of(_keys(t)),
            listen=Statement.of(f"LISTEN {_escape(quote(heard, 'channel'))}"),
            unlisten=Statement.of(f"UNLISTEN {_escape(quote(heard, 'channel'))}"),
        )

    def acquire_semaphore_of(self, permits: int) -> Statement:
        """``acquire_semaphore`` with ``permits`` written in (rule 8): no ``%(permits)s``."""
        return Statement.of(
            _acquire(_escape(self.table), self.fencing, semaphore=True, permits=permits)
        )


# A slot's number as dmutex writes it (no sign, no leading zero), below MAX_PERMITS.
_SLOT_TEXT = "'^(0|[1-9][0-9]{0,3})$'"


def _keys(t: str) -> str:
    """The held keys of slots 0 .. %(permits)s - 1, each once, the first %(limit)s in byte order.

    A row's slot is the text between ``permit:`` and the next ``:``, read as
    a number only where it is one as dmutex writes it (the ``CASE`` keeps
    the cast from any other text); the key is what follows it.
    """
    return (
        'SELECT DISTINCT substr(p."key", length(p.slot) + 9) COLLATE "C" AS k\n'
        'FROM (SELECT "key", split_part("key", \':\', 2) AS slot FROM '
        f"{t}\n"
        f'  WHERE "key" LIKE \'permit:%%\' AND "expired_at" > {_NOW}) AS p\n'
        f"WHERE CASE WHEN p.slot ~ {_SLOT_TEXT} THEN p.slot::int END < %(permits)s::int\n"
        '  AND length(p."key") > length(p.slot) + 8\n'
        "ORDER BY k LIMIT %(limit)s::int"
    )


def _acquire(t: str, fencing: bool, *, semaphore: bool, permits: int | None = None) -> str:
    """The acquire of a mutex (slot 0, tried whatever it holds) or a semaphore (one free slot).

    A semaphore's slots are 0 .. ``permits`` - 1, written in (rule 8), or
    0 .. ``%(permits)s`` - 1 if ``permits`` is None.
    """
    last = "%(permits)s::int - 1" if permits is None else str(permits - 1)
    take = (
        f'INSERT INTO {t} AS t ("key", "value", "expired_at")\n'
        "  {rows}\n"
        '  ON CONFLICT ("key") DO UPDATE\n'
        '  SET "value" = EXCLUDED."value", "expired_at" = EXCLUDED."expired_at"\n'
        f'  WHERE t."expired_at" <= {_NOW} OR t."value" = EXCLUDED."value"\n'
        '  RETURNING t."key", t."expired_at"'
    )
    if semaphore:
        # The caller's own row first (a re-sent copy of this acquire), else a
        # random free or expired one, so that callers racing spread out.
        ctes = (
            f"slot AS ({_names('0', last)}),\n"
            'seen AS (SELECT slot.i, slot.name, r."value", r."expired_at"\n'
            f'  FROM slot LEFT JOIN {t} AS r ON r."key" = slot.name),\n'
            "pick AS (SELECT i, name FROM seen\n"
            '  WHERE "value" = %(token)s::text OR "expired_at" IS NULL'
            f' OR "expired_at" <= {_NOW}\n'
            '  ORDER BY ("value" = %(token)s::text) IS TRUE DESC, random() LIMIT 1),\n'
            "taken AS (\n"
            + take.format(rows=f"SELECT name, %(token)s::text, {_EXPIRY} FROM pick")
            + "\n)"
        )
        slot = '(SELECT pick.i FROM pick JOIN taken ON taken."key" = pick.name)'
        raced = "EXISTS (SELECT 1 FROM pick) AND NOT EXISTS (SELECT 1 FROM taken)"
    else:
        ctes = (
            'seen AS (SELECT "value", "expired_at" FROM '
            f"{t} WHERE \"key\" = 'permit:0:' || %(key)s::text),\n"
            "taken AS (\n"
            + take.format(rows=f"VALUES ('permit:0:' || %(key)s::text, %(token)s::text, {_EXPIRY})")
            + "\n)"
        )
        slot = "(SELECT 0 FROM taken)"
        raced = "false"
    # Rule 7: a failed attempt that waits marks the key's waiters.
    ctes += (
        ",\nmarked AS (\n"
        f'  INSERT INTO {t} AS t ("key", "value", "expired_at")\n'
        f"  SELECT 'waiters:' || %(key)s::text, '{WAITERS}',\n"
        f"    {_NOW} + %(waiting)s::bigint * interval '1 millisecond'\n"
        "  WHERE %(waiting)s::bigint > 0 AND NOT EXISTS (SELECT 1 FROM taken)\n"
        '  ON CONFLICT ("key") DO UPDATE\n'
        '  SET "expired_at" = greatest(t."expired_at", EXCLUDED."expired_at")\n'
        f"  WHERE t.\"value\" = '{WAITERS}'\n"
        ")"
    )
    fence = "NULL::bigint"
    foreign = "NULL::int"
    if fencing:
        # Rule 4. The failing cast reads a column of the grant, so that the
        # planner cannot fold it into an error while planning.
        ctes += (
            ",\nfenced AS (\n"
            f'  INSERT INTO {t} AS t ("key", "value", "expired_at")\n'
            f"  SELECT 'fence:' || %(key)s::text, {_NOW_US}::text, {_FOREVER} FROM taken\n"
            '  ON CONFLICT ("key") DO UPDATE\n'
            '  SET "value" = greatest(t."value"::bigint + 1, EXCLUDED."value"::bigint)::text\n'
            f'  WHERE t."expired_at" = {_FOREVER} AND t."value" ~ {_COUNT}\n'
            '  RETURNING t."value"::bigint AS fence\n'
            ")"
        )
        fence = "(SELECT fence FROM fenced)"
        foreign = (
            "CASE WHEN EXISTS (SELECT 1 FROM taken) AND NOT EXISTS (SELECT 1 FROM fenced)\n"
            "  THEN (SELECT ('dmutex: the row fence:' || %(key)s::text || "
            f"' of {_in_literal(t)} {FOREIGN}' || left(taken.\"key\", 0))::int FROM taken) END"
        )
    return (
        f"WITH {ctes}\n"
        f"SELECT {slot} AS slot,\n"
        f"  (SELECT {_ms('expired_at')} FROM taken) AS expires,\n"
        f"  {fence} AS fence,\n"
        f"  (SELECT {_ms('min(expired_at)')} FROM seen\n"
        f'    WHERE expired_at > {_NOW} AND "value" IS DISTINCT FROM %(token)s::text) AS ends,\n'
        f"  {_ms(_NOW)} AS now,\n"
        f"  {raced} AS raced,\n"
        f"  {foreign} AS foreign_row"
    )


def _escape(text: str) -> str:
    """``text`` with ``%`` doubled, as psycopg's placeholder syntax needs it outside them."""
    return text.replace("%", "%%")


def _in_literal(text: str) -> str:
    """SQL text (escaped for psycopg already) inside an SQL string literal: quotes doubled."""
    return text.replace("'", "''")


# What ready() reads of the table: whether a relation of that name exists and
# its kind, its columns and primary key (COLUMNS, PRIMARY_KEY), and whether
# the index exists beside it.
_SHAPE = """\
SELECT c.relkind::text,
  (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
     || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END, ', ' ORDER BY a.attnum)
   FROM pg_attribute AS a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
  (SELECT string_agg(a.attname, ', ' ORDER BY k.n)
   FROM pg_index AS i, unnest(i.indkey) WITH ORDINALITY AS k(attnum, n), pg_attribute AS a
   WHERE i.indrelid = c.oid AND i.indisprimary AND a.attrelid = c.oid AND a.attnum = k.attnum),
  EXISTS (SELECT 1 FROM pg_class AS x
          WHERE x.relname = %(index)s::text AND x.relnamespace = c.relnamespace
            AND x.relkind = 'i')
FROM (SELECT to_regclass(%(table)s::text) AS oid) AS r LEFT JOIN pg_class AS c ON c.oid = r.oid"""
