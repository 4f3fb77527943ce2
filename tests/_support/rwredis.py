"""What a Redis server holds of dmutex's read-write locks, read by a client of the test's own.

A lock is one hash, ``f"{key_prefix}rwlock:{key}"``
(``src/dmutex/_backends/redis/readwrite.py``, rule 1): its ``w:<token>``,
``r:<token>`` and ``i:<token>`` fields hold the writer's, each reader's and
each waiting writer's intent's expiry in epoch milliseconds by the server's
clock, and the hash expires (``PEXPIREAT``) with the latest of them. A field
is live while its expiry is after the server's ``TIME``.

:func:`read` takes one hash, the server's time and the hash's
``PEXPIRETIME`` in one ``MULTI`` (Redis 7.0 or later), so that what it says
is live was live at one instant. :func:`live` gathers the live fields of
every lock under a prefix as ``{"<hash>#<field>": token}``, the names that
:func:`drop` deletes again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

HOLDS = ("w:", "r:")
"""The fields of holds: the writer's and the readers'."""
INTENTS = ("i:",)
"""The fields of waiting writers' intents."""
SEPARATOR = "#"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def hash_name(prefix: str, key: str) -> str:
    """The hash of lock ``key`` under the Redis ``key_prefix`` ``prefix``."""
    return f"{prefix}rwlock:{key}"


@dataclass(frozen=True)
class RWHash:
    """One lock's hash at one instant: its fields, the server's time, its expiry."""

    name: str
    now_ms: int  # the server's TIME, in ms
    fields: dict[str, str]  # empty: no such key
    expire_at_ms: int  # PEXPIRETIME: -1 the key has no expiry, -2 there is no key

    @property
    def exists(self) -> bool:
        return self.expire_at_ms != -2

    def live(self, kinds: Iterable[str] = HOLDS) -> dict[str, str]:
        """The live fields of ``kinds`` (their prefixes, ``"w:"``...): field -> token."""
        prefixes = tuple(kinds)
        return {
            field: field[2:]
            for field, value in self.fields.items()
            if field.startswith(prefixes) and int(value) > self.now_ms
        }

    def untimed(self) -> bool:
        """Whether the hash has no expiry, or one before a live hold's or intent's: it would
        vanish (and its key be free) while someone still holds it."""
        if not self.exists:
            return False
        ends = [int(v) for f, v in self.fields.items() if f.startswith((*HOLDS, *INTENTS))]
        latest = max((end for end in ends if end > self.now_ms), default=0)
        return self.expire_at_ms == -1 or self.expire_at_ms < latest

    def named(self, kinds: Iterable[str] = HOLDS) -> dict[str, str]:
        """:meth:`live`, each field named ``"<hash>#<field>"`` (as :func:`drop` takes them)."""
        return {
            f"{self.name}{SEPARATOR}{field}": token for field, token in self.live(kinds).items()
        }


def read(client: redis.Redis, name: str) -> RWHash:
    """Hash ``name``, the server's time and the hash's ``PEXPIRETIME``, in one ``MULTI``."""
    with client.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.hgetall(name)
        pipe.pexpiretime(name)
        (seconds, micros), fields, expire_at = pipe.execute()
    return RWHash(
        name,
        int(seconds) * 1000 + int(micros) // 1000,
        {_text(field): _text(value) for field, value in fields.items()},
        int(expire_at),
    )


def hashes(client: redis.Redis, prefix: str) -> list[RWHash]:
    """Every lock's hash under ``prefix`` (one :func:`read` each)."""
    names = sorted(_text(name) for name in client.scan_iter(match=f"{prefix}rwlock:*"))
    return [found for found in (read(client, name) for name in names) if found.exists]


def live(client: redis.Redis, prefix: str, kinds: Iterable[str] = HOLDS) -> dict[str, str]:
    """The live fields of ``kinds`` of every lock under ``prefix``, :meth:`RWHash.named`."""
    kinds = tuple(kinds)
    return {
        name: token
        for found in hashes(client, prefix)
        for name, token in found.named(kinds).items()
    }


def drop(client: redis.Redis, names: Iterable[str]) -> None:
    """Delete the fields ``names`` (as :func:`live` names them), leaving the rest of each hash."""
    for name in names:
        record, _, field = name.rpartition(SEPARATOR)
        client.hdel(record, field)
