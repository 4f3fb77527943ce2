"""The SQL of the MySQL store, one builder per statement, for one table.

They sit in ``dmutex._backends.mysql`` beside the store that runs them
(``store.py``); tests and benchmarks import them from here.

Rules of the statements:

1. Time is the server's: :data:`NOW_MS`, the moment the statement began
   (``UTC_TIMESTAMP(6)`` is read once per statement, as ``NOW()`` is),
   counted from the epoch by ``TIMESTAMPDIFF``, which no session time zone
   or daylight-saving hour can shift. Expiries are ``bigint`` epoch
   milliseconds, as the TypeScript store writes them from its host's clock.
2. A statement answers in its OK packet when it can, so that it needs no
   ``SELECT`` after it: MySQL has no ``RETURNING`` on ``INSERT`` or
   ``UPDATE`` (MariaDB's covers ``INSERT`` and ``DELETE`` only), but
   ``LAST_INSERT_ID(expr)`` sets the id that the OK packet carries to
   ``expr`` (the documented way to build a sequence). The take of a slot
   sets it to one integer that says everything (:func:`granted`,
   :func:`refused`); an extend sets it to the new expiry; a fence advance
   to the fence. A statement that never reaches one (an ``UPDATE`` that
   matched no row) answers 0. Affected-row counts are not read where a
   driver's ``CLIENT_FOUND_ROWS`` flag changes them (an upsert that changed
   nothing counts 0 without it, 1 with it).
3. A slot is taken by an upsert whose ``ON DUPLICATE KEY UPDATE`` changes
   only a row that has expired or already holds the caller's token (a
   re-sent copy of an acquire whose reply was lost): InnoDB runs it under
   the row's lock, so a held row is never overwritten. Both assignments test
   the same condition, which reads the same on the row before and after
   the first assignment: MySQL's left-to-right order and MariaDB's
   ``SIMULTANEOUS_ASSIGNMENT`` mode decide it alike.
4. The fence counter is the row ``fence:{key}``, its value the counter in
   decimal, its ``expired_at`` :data:`FOREVER` (9999-01-01), so that no
   acquire takes it for a lease. It advances (``dmutex._core.fences``, rule
   1, the clock's part being the statement's ms times 1,000, as MongoDB's
   is) in the grant's own statement (:meth:`Statements.take_fenced`: the
   slot's row and the counter's row in one ``INSERT``), which answers the
   fence as its distance from that clock reading, in :data:`FENCE_BITS`
   bits. Only when it does not fit (a counter 16 ms or more ahead of the
   clock: a clock that stepped back, or 16,383 grants in one ms) or the
   row is not dmutex's does the store send a second statement (``fence``),
   which advances it alone, and answers 0 for a row dmutex did not write.
   Only a grant writes the counter's row: a refused take neither makes nor
   moves it (:func:`_take_fenced`), so a key never granted has none.
5. Keys and values compare byte for byte: dmutex creates both columns
   ``utf8mb4`` with a binary collation that does not pad (MariaDB's
   ``utf8mb4_nopad_bin``, MySQL 8's ``utf8mb4_0900_bin``: :data:`COLLATIONS`),
   so ``permit:0:A`` and ``permit:0:a``, ``é`` and ``e``, ``k`` and ``k ``
   are two rows each (``utf8mb4_bin`` pads with spaces, so the last two
   would be one), and a 4-byte UTF-8 character is stored as sent. The
   columns' types and sizes are the TypeScript store's; only their character
   set and collation are named (``ready()`` refuses a table whose text
   columns compare otherwise). No statement names a collation: every text
   it compares with a column is a literal or a parameter, which takes the
   column's, so any of :data:`COLLATIONS` serves, and the key's index too.
6. Parameters are named, ``%(name)s``: PyMySQL, mysqlclient,
   mysql-connector, aiomysql and asyncmy all take that form with a mapping,
   and escape the values themselves. A statement without parameters is
   sent without a mapping, so it is written without ``%%`` escapes.
7. A semaphore's slots of one key are rows ``permit:0:k`` ..
   ``permit:{n-1}:k``, far apart in the primary key, so each is one
   primary-key lookup. Up to :data:`LISTED` permits a statement names them
   as parameters (an ``IN`` list: no table to build); beyond, it joins the
   table with the numbers 0 .. n-1 built in the statement (:data:`_NUMBERS`:
   0 .. 31 by a recursive CTE, crossed with itself, since both servers stop
   a recursion at 1,000 rows by default), and the semaphore's read before a
   take aggregates what it found into one row (:meth:`Statements.pick`)
   rather than answer a row per held slot (1,024 rows cost PyMySQL more to
   parse than the server to find). ``benchmarks/README.md`` has the
   measurements that chose both.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._core.lease import MAX_EXPIRY_MS
from ..._errors import InvalidArgumentError

__all__ = [
    "COLLATIONS",
    "FENCE_BITS",
    "FOREVER",
    "UNKNOWN_FENCE",
    "Statement",
    "Statements",
    "fence_of",
    "granted",
    "quote",
    "refused",
]

# Rule 1: the statement's start, in epoch microseconds and milliseconds.
# (The epoch as a typed literal: parsed once, not cast from a string at each use.)
NOW_US = "TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
NOW_MS = f"({NOW_US} DIV 1000)"
# A fence row's expiry (rule 4): 9999-01-01 00:00:00 UTC in epoch ms.
FOREVER = 253370764800000
# Rule 5: what dmutex creates its text columns with, and needs of the key column.
CHARSET = "utf8mb4"
COLLATIONS = {"mariadb": "utf8mb4_nopad_bin", "mysql": "utf8mb4_0900_bin"}

# The take's answer (rule 2), one integer below 2**63: a grant is odd,
#   expiry ms << FENCE_BITS + 1 | fence offset << 1 | 1,
# the offset being the grant's fence less the statement's ms times 1,000
# (0 unfenced; UNKNOWN_FENCE: advance the fence apart, rule 4); a refusal
# is even: the ms until the lease in the way ends, << 1.
FENCE_BITS = 14
UNKNOWN_FENCE = (1 << FENCE_BITS) - 1
_GRANT_SHIFT = FENCE_BITS + 1
assert (MAX_EXPIRY_MS << _GRANT_SHIFT) | (1 << _GRANT_SHIFT) - 1 < 1 << 63
# A refusal's wait is cut to this many ms (about 35 years), so that a row
# another program wrote with a huge expiry cannot overflow the answer.
_LONGEST_WAIT = 1 << 40


def granted(answer: int) -> int | None:
    """The expiry (epoch ms) a take's answer grants; None if it refused."""
    return answer >> _GRANT_SHIFT if answer & 1 else None


def fence_of(answer: int, ttl_ms: int) -> int | None:
    """The fence of a fenced take's grant; None if it must be advanced apart (rule 4)."""
    offset = (answer >> 1) & UNKNOWN_FENCE
    if offset == UNKNOWN_FENCE:
        return None
    return ((answer >> _GRANT_SHIFT) - ttl_ms) * 1000 + offset


def refused(answer: int) -> int:
    """The ms until the lease in the way ends, from a refusing take's answer."""
    return answer >> 1


def quote(identifier: str, what: str = "table_name") -> str:
    """An identifier in backquotes, as the TypeScript store quotes it, refusing what it does."""
    if not isinstance(identifier, str) or not identifier or "\0" in identifier:
        raise InvalidArgumentError(
            f"a MySQL {what} must be a non-empty string without NUL bytes, not {identifier!r}"
        )
    return "`" + identifier.replace("`", "``") + "`"


def qualified(table: str, database: str | None) -> str:
    """The table as statements name it, in backquotes: with its database, or in the current one."""
    name = quote(table)
    return name if database is None else f"{quote(database, 'database_name')}.{name}"


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement's text, and whether it takes parameters (rule 6)."""

    text: str
    takes_params: bool = True


# Rule 7: at most this many permits are named in a statement as parameters.
LISTED = 32
# Rule 7: the slots first .. last of %(key)s, as rows (i), from 0 .. 31 crossed.
_NUMBERS = (
    "(WITH RECURSIVE d(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 31)\n"
    "  SELECT h.n * 32 + l.n AS i FROM d AS h JOIN d AS l ON h.n <= %(last)s DIV 32\n"
    "  WHERE h.n * 32 + l.n BETWEEN %(first)s AND %(last)s)"
)
_SLOT_NAME = "CONCAT('permit:', s.i, ':', %(key)s)"

# Rule 3: a row the caller may take.
_FREE = f"(`expired_at` <= {NOW_MS} OR `value` = %(token)s)"
_GRANT = f"LAST_INSERT_ID(({NOW_MS} + %(ttl)s) * {1 << _GRANT_SHIFT} + 1)"
_EXPIRY = f"{_GRANT} DIV {1 << _GRANT_SHIFT}"
_REFUSAL = f"LAST_INSERT_ID(LEAST(`expired_at` - {NOW_MS}, {_LONGEST_WAIT}) * 2)"
# A fence counter as dmutex writes it: decimal digits that fit a bigint plus one.
_COUNT = "'^[0-9]{1,18}$'"
# Rule 4: the fence a grant of this statement gets, from a counter of dmutex's,
# and its offset from the statement's ms times 1,000 (the clock's part).
_CLOCK_US = f"({NOW_MS} * 1000)"
_NEXT = f"GREATEST(CAST(`value` AS UNSIGNED) + 1, {_CLOCK_US})"
_OURS = f"`expired_at` = {FOREVER} AND `value` REGEXP {_COUNT}"


@dataclass(frozen=True, slots=True)
class Statements:
    """Every statement of one table (in ``database_name``, optional)."""

    table: str
    name: str
    database: str | None
    shape: Statement
    take: Statement
    take_fenced: Statement
    fence: Statement
    release: Statement
    release_any: Statement
    extend: Statement
    extend_any: Statement
    holders: Statement
    keys: Statement

    @classmethod
    def of(cls, table: str, database: str | None = None) -> Statements:
        """The statements of ``table`` in ``database`` (None: the connection's current one)."""
        named = qualified(table, database)
        # Identifiers may hold "%", which a driver would read as a placeholder.
        t = named.replace("%", "%%")
        active = f"`expired_at` > {NOW_MS}"
        mine = f"`key` = %(row)s AND `value` = %(token)s AND {active}"
        joined = f"{t} AS t JOIN {_NUMBERS} AS s ON t.`key` = {_SLOT_NAME}"
        mine_any = f"t.`value` = %(token)s AND t.{active}"
        return cls(
            table=named,
            name=table,
            database=database,
            shape=Statement(_SHAPE),
            take=Statement(
                f"INSERT INTO {t} (`key`, `value`, `expired_at`)\n"
                f"VALUES (%(row)s, %(token)s, {_EXPIRY})\n"
                "ON DUPLICATE KEY UPDATE\n"
                f"  `value` = IF({_FREE}, %(token)s, `value`),\n"
                f"  `expired_at` = IF({_FREE}, {_EXPIRY}, `expired_at` + 0 * {_REFUSAL})"
            ),
            take_fenced=Statement(_take_fenced(t)),
            fence=Statement(
                f"INSERT INTO {t} (`key`, `value`, `expired_at`)\n"
                f"VALUES (%(row)s, LAST_INSERT_ID({_CLOCK_US}), {FOREVER})\n"
                "ON DUPLICATE KEY UPDATE\n"
                f"  `value` = IF({_OURS}, LAST_INSERT_ID({_NEXT}),\n"
                "    CONCAT(`value`, LEFT(LAST_INSERT_ID(0), 0)))"
            ),
            release=Statement(f"DELETE FROM {t} WHERE {mine}"),
            release_any=Statement(f"DELETE t FROM {joined}\nWHERE {mine_any}"),
            extend=Statement(
                f"UPDATE {t} SET `expired_at` = LAST_INSERT_ID({NOW_MS} + %(ttl)s)\nWHERE {mine}"
            ),
            extend_any=Statement(
                f"UPDATE {joined}\nSET t.`expired_at` = LAST_INSERT_ID({NOW_MS} + %(ttl)s)\n"
                f"WHERE {mine_any}"
            ),
            holders=Statement(
                f"SELECT NULL, f.`value`, NULL, {NOW_MS}\n"
                f"FROM (SELECT 1) AS one LEFT JOIN {t} AS f\n"
                "  ON f.`key` = CONCAT('fence:', %(key)s)\n"
                f"  AND f.`expired_at` = {FOREVER} AND f.`value` REGEXP {_COUNT}\n"
                "UNION ALL\n"
                f"SELECT s.i, t.`value`, t.`expired_at`, {NOW_MS}\n"
                f"FROM {joined}\nWHERE t.{active}"
            ),
            keys=Statement(_keys(t)),
        )

    def create(self, flavour: str, value_type: str = "varchar(128)") -> Statement:
        """The TypeScript store's ``CREATE TABLE``, its text columns in ``flavour``'s collation.

        ``value_type``: the ``value`` column's (the read-write store's is ``mediumtext``).
        """
        collation = COLLATIONS[flavour]
        text = f"CHARACTER SET {CHARSET} COLLATE {collation} NOT NULL"
        return Statement(
            f"CREATE TABLE IF NOT EXISTS {self.table} (\n"
            f"  `key` varchar(512) {text},\n"
            f"  `value` {value_type} {text},\n"
            "  `expired_at` bigint NOT NULL,\n"
            "  PRIMARY KEY (`key`),\n"
            "  INDEX `expired_at_idx` (`expired_at`)\n"
            ") ENGINE=InnoDB",
            takes_params=False,
        )

    def pick(self, permits: int) -> Statement:
        """A semaphore's read before its take: what it needs to choose a slot (rule 7).

        Up to :data:`LISTED` permits: the active rows among ``name0`` ..
        ``name{permits-1}``, as ``(key, value, expiry, now)``, then a row
        ``(NULL, NULL, NULL, now)``. Beyond: one row ``(mine, after, ends,
        now)``: the slot holding ``%(token)s`` (NULL if none), the first free
        slot at or after ``%(start)s`` as its distance from it, cyclically
        (NULL if none: a random start spreads racing callers), and the
        earliest expiry of another's active lease.
        """
        t = self.table.replace("%", "%%")
        if permits <= LISTED:
            names = ", ".join(f"%(name{n})s" for n in range(permits))
            return Statement(
                f"SELECT `key`, `value`, `expired_at`, {NOW_MS} FROM {t}\n"
                f"WHERE `key` IN ({names}) AND `expired_at` > {NOW_MS}\n"
                f"UNION ALL SELECT NULL, NULL, NULL, {NOW_MS}"
            )
        active = f"t.`expired_at` > {NOW_MS}"
        return Statement(
            f"SELECT MAX(IF({active} AND t.`value` = %(token)s, s.i, NULL)),\n"
            f"  MIN(IF(t.`key` IS NULL OR NOT {active},\n"
            f"    (s.i + {permits} - %(start)s) MOD {permits}, NULL)),\n"
            f"  MIN(IF({active} AND t.`value` <> %(token)s, t.`expired_at`, NULL)),\n"
            f"  {NOW_MS}\n"
            f"FROM {_NUMBERS} AS s LEFT JOIN {t} AS t ON t.`key` = {_SLOT_NAME}"
        )

    def extend_many(self, count: int) -> Statement:
        """Extend ``count`` leases (``name{n}``, ``token{n}``, ``ttl{n}``) that are still active.

        Its answer is the number of rows it changed; :meth:`renewed` reads back which.
        """
        t = self.table.replace("%", "%%")
        ttls = "".join(
            f" WHEN `key` = %(name{n})s AND `value` = %(token{n})s THEN %(ttl{n})s"
            for n in range(count)
        )
        return Statement(
            f"UPDATE {t} SET `expired_at` = {NOW_MS} + CASE{ttls} END\n"
            f"WHERE (`key`, `value`) IN ({_pairs(count)}) AND `expired_at` > {NOW_MS}"
        )

    def renewed(self, count: int) -> Statement:
        """The rows ``(key, value, expiry)`` of the ``count`` leases asked that are active."""
        t = self.table.replace("%", "%%")
        return Statement(
            f"SELECT `key`, `value`, `expired_at` FROM {t}\n"
            f"WHERE (`key`, `value`) IN ({_pairs(count)}) AND `expired_at` > {NOW_MS}"
        )


def _take_fenced(t: str) -> str:
    """The take and its fence in one statement (rule 4): the slot's row, then the counter's.

    MySQL and MariaDB write the rows of an ``INSERT`` one after the other,
    each row's values and updates evaluated as it is written, so the
    counter's expressions read the slot's outcome from ``LAST_INSERT_ID()``
    (odd: granted), which the slot's row set in this statement. A granted
    take adds the fence's offset to the answer; a counter that is not
    dmutex's, or an offset that does not fit, leaves it unmoved and adds
    :data:`UNKNOWN_FENCE`: the store then advances it apart (``fence``).

    A refused take writes no counter: its second row is named
    ``IF(granted, %(fence)s, %(row)s)``, so that after a refusal it is the
    slot's own row again, which exists (it refused), and meets the slot's
    update a second time, which changes nothing and answers the same
    refusal. So only a grant makes the counter (at the clock's value, its
    fence) or moves it; a key never granted has none, and ``dmutex
    status`` shows it no fence.
    """
    granted_here = "LAST_INSERT_ID() & 1 = 1"
    offset = f"{_NEXT} - {_CLOCK_US}"
    advance = f"{granted_here} AND {_OURS} AND {offset} < {UNKNOWN_FENCE}"
    unknown = f"LAST_INSERT_ID() + IF({granted_here}, {UNKNOWN_FENCE * 2}, 0)"
    counter = (
        f"IF({advance},\n"
        f"      {_NEXT} + 0 * LAST_INSERT_ID(LAST_INSERT_ID() + 2 * ({offset})),\n"
        f"      CONCAT(`value`, LEFT(LAST_INSERT_ID({unknown}), 0)))"
    )
    return (
        f"INSERT INTO {t} (`key`, `value`, `expired_at`)\n"
        f"VALUES (%(row)s, %(token)s, {_EXPIRY}),\n"
        f"  (IF({granted_here}, %(fence)s, %(row)s), {_CLOCK_US}, {FOREVER})\n"
        "ON DUPLICATE KEY UPDATE\n"
        f"  `value` = IF(`key` = %(row)s, IF({_FREE}, %(token)s, `value`),\n"
        f"    {counter}),\n"
        f"  `expired_at` = IF(`key` = %(row)s,\n"
        f"    IF({_FREE}, {_EXPIRY}, `expired_at` + 0 * {_REFUSAL}), `expired_at`)"
    )


# A slot's number as dmutex writes it (no sign, no leading zero), below MAX_PERMITS.
_SLOT_TEXT = "'^(0|[1-9][0-9]{0,3})$'"


def _keys(t: str) -> str:
    """The held keys of slots 0 .. %(permits)s - 1, each once, the first %(limit)s in order.

    A row's slot is the text between ``permit:`` and the next ``:``, read as
    a number only where it is one as dmutex writes it; the key is what
    follows it. The key column's binary collation (rule 5) orders them byte
    for byte and makes ``LIKE 'permit:%'`` a range of the primary key.
    """
    return (
        "SELECT DISTINCT SUBSTRING(p.`key`, CHAR_LENGTH(p.slot) + 9) AS k\n"
        "FROM (SELECT `key`, SUBSTRING_INDEX(SUBSTRING(`key`, 8), ':', 1) AS slot\n"
        f"  FROM {t} WHERE `key` LIKE 'permit:%%' AND `expired_at` > {NOW_MS}) AS p\n"
        f"WHERE IF(p.slot REGEXP {_SLOT_TEXT}, CAST(p.slot AS UNSIGNED), NULL) < %(permits)s\n"
        "  AND CHAR_LENGTH(p.`key`) > CHAR_LENGTH(p.slot) + 8\n"
        "ORDER BY k LIMIT %(limit)s"
    )


def _pairs(count: int) -> str:
    """The rows ``(name{n}, token{n})`` for n < ``count``: an index range on the key."""
    return ", ".join(f"(%(name{n})s, %(token{n})s)" for n in range(count))


# What ready() reads, in one statement: first a row of the session (the
# server's version, the session's character set and SQL mode), then a row
# per column of the table if it exists (the table's kind and engine, the
# column's name, type, nullability, collation and key, whether the index
# exists). Each information_schema table is filtered by constant schema and
# table names, which lets both servers read one table's definition instead
# of every table's.
_WHERE = "TABLE_SCHEMA = COALESCE(%(database)s, DATABASE()) AND TABLE_NAME = %(table)s"
_SHAPE = f"""\
SELECT 0, VERSION(), @@character_set_client, @@SESSION.sql_mode, NULL, NULL, NULL, NULL, NULL
UNION ALL
SELECT c.ORDINAL_POSITION,
  (SELECT TABLE_TYPE FROM information_schema.TABLES WHERE {_WHERE}),
  (SELECT ENGINE FROM information_schema.TABLES WHERE {_WHERE}),
  c.COLUMN_NAME, c.COLUMN_TYPE, c.IS_NULLABLE, c.COLLATION_NAME, c.COLUMN_KEY,
  EXISTS (SELECT 1 FROM information_schema.STATISTICS
          WHERE {_WHERE} AND INDEX_NAME = 'expired_at_idx' AND COLUMN_NAME = 'expired_at')
FROM information_schema.COLUMNS AS c
WHERE c.{_WHERE}
ORDER BY 1"""
