"""A holder paused past its TTL cannot touch the lease that replaced it.

A process is stopped by SIGSTOP while it holds a lease (a garbage-collection
pause, a VM migration, a laptop lid): its lease runs out, another holder takes
the key, and then the process is continued by SIGCONT. It does not know that
time passed, so it goes on as if it still held the lease: it extends it and
releases it, by handle and by token. All four calls must return False and
leave the new holder's record as it was: the same token, and an expiry not
moved later (``PTTL`` on Redis, ``expiredAt`` on the MongoDB test server,
``expired_at`` on PostgreSQL, read by a plain psycopg connection).

How: the holder is a child process (``spawn``) that acquires with a
0.5 s TTL, reports its token and slot, and waits on an event. The test stops
it, checks that the kernel shows it stopped, polls the server until the
lease has expired, takes the key with a long TTL, reads the new record, then
continues the child and sets the event. The child's extend asks for a TTL
longer than the new holder's, so a wrong extend would show as a later expiry.
For a semaphore of two permits the test holds the other permit first, so the
child and then the new holder must use the same slot.

Covered: Redis (one server of the pool, 7.0 where there is one), the
MongoDB test server (SecantusDB here) and PostgreSQL (the session's server,
in its schema; the holder on a psycopg connection, or an asyncpg one for the
asyncio face), each with DMutex and DSemaphore(max_permits=2), each from a
sync and an asyncio holder. PostgreSQL keeps an expired row until the next
acquire of its slot overwrites it, so the test waits for its ``expired_at``
to pass by the server's clock, as on MongoDB.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal, TypeAlias

import psycopg
import pymongo
import pytest
import redis
from psycopg import sql

from dmutex import DMutex, DSemaphore
from tests._support import pausing, processes
from tests._support.faces import Face, FaceName
from tests._support.mongo_servers import Session
from tests._support.pausing import CALLS, FILL_TTL, NEW_TTL, TTL, Record, slot_of
from tests._support.redis_servers import Pool
from tests._support.sampling import until

Backend: TypeAlias = Literal["redis", "mongodb", "postgresql"]
Kind: TypeAlias = Literal["mutex", "semaphore"]
Doc: TypeAlias = dict[str, Any]
Reports: TypeAlias = processes.ChildReports

KEY = "nightly-report"
PERMITS = 2  # the semaphore's; a mutex has one
START_TIMEOUT = 60.0  # spawning and importing on a busy 2-core machine
STEP_TIMEOUT = 20.0  # any one wait of the test or of the child
POLL = 0.01
WANTED_REDIS = "redis-7.0"


@dataclass(frozen=True)
class Case:
    backend: Backend
    kind: Kind
    face: FaceName

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.kind}-{self.face}"

    @property
    def permits(self) -> int:
        return PERMITS if self.kind == "semaphore" else 1


CASES = [
    Case(backend, kind, face)
    for backend in ("redis", "mongodb", "postgresql")
    for kind in ("mutex", "semaphore")
    for face in ("sync", "async")
]


# --- the child: acquire, report, wait, then act on the stale lease -------------------------


def _where(backend: Backend, db_name: str | None) -> tuple[str, str | None]:
    """The lock's ``db_name`` and ``schema_name``: the test's ``db_name`` is PostgreSQL's schema."""
    if backend == "postgresql":
        return "dmutex", db_name
    return db_name or "dmutex", None  # the default database; Redis ignores it


def _holder(
    case: Case,
    url: str,
    db_name: str | None,
    service: str,
    reports: Reports,
    go: multiprocessing.synchronize.Event,
) -> dict[str, bool]:
    database, schema = _where(case.backend, db_name)
    with pausing.holder_client(case, url) as (client, loop):
        face = Face(
            case.face,
            case.kind,
            client,
            service_name=service,
            max_permits=PERMITS,
            loop=loop,
            db_name=database,
            schema_name=schema,
        )
        lease = face.acquire(KEY, ttl=TTL)
        assert lease is not None, "the key should be free for the holder"
        reports.put(("acquired", (lease.token, lease.slot)))
        assert go.wait(STEP_TIMEOUT), "the test never let the holder go on"
        # Continued: the holder acts as if no time had passed.
        return pausing.stale_calls(face, KEY, lease)


# --- the parent side: what the server holds ----------------------------------------------


def _instance(case: Case, client: Any, service: str, db_name: str | None) -> DMutex | DSemaphore:
    """The parent side's lock or semaphore, on its own client."""
    database, schema = _where(case.backend, db_name)
    if case.kind == "mutex":
        return DMutex(service, client, db_name=database, schema_name=schema)
    return DSemaphore(service, client, max_permits=PERMITS, db_name=database, schema_name=schema)


class RedisSide:
    """The test's view of a Redis server: its own client, and the slot keys."""

    def __init__(self, url: str, case: Case, service: str) -> None:
        self.url = url
        self.case = case
        self.service = service
        self.db_name: str | None = None
        self.client = redis.Redis.from_url(url)

    def instance(self) -> DMutex | DSemaphore:
        return _instance(self.case, self.client, self.service, None)

    def _name(self, slot: int) -> str:
        prefix = "_dmutex_" if self.case.kind == "mutex" else "_dsemaphore_"
        return f"{prefix}{self.service}:permit:{slot}:{KEY}"

    def record(self, slot: int) -> Record:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.get(self._name(slot))
            pipe.pttl(self._name(slot))
            value, pttl = pipe.execute()
        token = value.decode() if isinstance(value, bytes) else None
        return Record(token, float(pttl) if token is not None else None)

    def expired(self, slot: int, token: str) -> bool:
        # Redis deletes the key once its expiry has passed.
        return self.record(slot).token != token

    def close(self) -> None:
        self.client.close()


class MongoSide:
    """The test's view of the MongoDB test server: a tz-aware client, the slot documents."""

    def __init__(self, url: str, db_name: str, case: Case, service: str) -> None:
        self.url = url
        self.case = case
        self.service = service
        self.db_name: str | None = db_name
        self.client: pymongo.MongoClient[Doc] = pymongo.MongoClient(
            url, tz_aware=True, serverSelectionTimeoutMS=10_000
        )
        prefix = "_dmutex_" if case.kind == "mutex" else "_dsemaphore_"
        self.collection = self.client.get_database(db_name).get_collection(f"{prefix}{service}")

    def instance(self) -> DMutex | DSemaphore:
        return _instance(self.case, self.client, self.service, self.db_name)

    def record(self, slot: int) -> Record:
        doc = self.collection.find_one({"_id": f"permit:{slot}:{KEY}"})
        if doc is None:
            return Record(None, None)
        return Record(doc.get("value"), doc.get("expiredAt"))

    def expired(self, slot: int, token: str) -> bool:
        # The document stays until the TTL monitor's next pass; expired is expiredAt <= now.
        found = self.record(slot)
        if found.token != token:
            return True
        assert isinstance(found.expiry, datetime)
        return found.expiry < datetime.now(timezone.utc)

    def close(self) -> None:
        self.client.close()


class PostgresSide:
    """The test's view of PostgreSQL: a plain psycopg connection, the slot rows.

    ``db_name`` is the schema the lock's table is in (the session's).
    """

    def __init__(self, url: str, schema: str, case: Case, service: str) -> None:
        self.url = url
        self.case = case
        self.service = service
        self.db_name: str | None = schema
        self.client: psycopg.Connection[tuple[Any, ...]] = psycopg.connect(url, autocommit=True)
        prefix = "_dmutex_" if case.kind == "mutex" else "_dsemaphore_"
        self.table = sql.Identifier(schema, f"{prefix}{service}")

    def instance(self) -> DMutex | DSemaphore:
        return _instance(self.case, self.client, self.service, self.db_name)

    def _row(self, slot: int) -> tuple[Any, ...] | None:
        query = sql.SQL(
            'SELECT "value", "expired_at", "expired_at" <= statement_timestamp() '
            'FROM {} WHERE "key" = %s'
        ).format(self.table)
        return self.client.execute(query, (f"permit:{slot}:{KEY}",)).fetchone()

    def record(self, slot: int) -> Record:
        row = self._row(slot)
        return Record(None, None) if row is None else Record(row[0], row[1])

    def expired(self, slot: int, token: str) -> bool:
        # The row stays until an acquire overwrites it; expired is expired_at <= now, by
        # the server's clock.
        row = self._row(slot)
        return row is None or row[0] != token or row[2] is True

    def close(self) -> None:
        self.client.close()


Side: TypeAlias = RedisSide | MongoSide | PostgresSide


def _one_label(pool: Pool) -> str:
    labels = pool.labels
    if WANTED_REDIS in labels:
        return WANTED_REDIS
    if not labels:
        pytest.skip(pool.discovery.reason)
    return labels[-1]


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def side(request: pytest.FixtureRequest) -> Iterator[Side]:
    """The case's server, seen by the test; only that backend's session fixture is used."""
    case: Case = request.param
    service = f"pause-{uuid.uuid4().hex[:8]}"  # fresh keys: nothing to flush
    made: Side
    if case.backend == "redis":
        pool: Pool = request.getfixturevalue("redis_pool")
        made = RedisSide(pool.server(_one_label(pool)).url, case, service)
    elif case.backend == "postgresql":
        url: str = request.getfixturevalue("postgres_server")
        schema: str = request.getfixturevalue("postgres_schema")
        made = PostgresSide(url, schema, case, service)
    else:
        session: Session = request.getfixturevalue("mongo_session")
        server = session.fresh()
        made = MongoSide(server.url, server.db_name, case, service)
    try:
        yield made
    finally:
        made.close()


# --- the test ------------------------------------------------------------------------------


def test_a_holder_paused_past_its_ttl_cannot_touch_its_successor(side: Side) -> None:
    """Stopped past its TTL and continued, the old holder's four calls return False and
    the new holder's record keeps its token and its expiry."""
    case = side.case
    instance = side.instance()
    filler = None
    if case.kind == "semaphore":
        # Hold the other permit, so that the child and the taker meet in one slot.
        filler = instance.acquire(KEY, ttl=FILL_TTL)
        assert filler is not None

    with pausing.spawned_holder(_holder, case, side.url, side.db_name, side.service) as child:
        acquired = child.report("acquired", START_TIMEOUT)
        assert isinstance(acquired, tuple)
        token, slot = acquired
        if filler is not None:
            assert slot != slot_of(filler), "the holder got the permit the test holds"
        child.stop(STEP_TIMEOUT, poll=POLL)
        until(
            lambda: side.expired(slot, token),
            "the paused holder's lease expired",
            STEP_TIMEOUT,
            poll=POLL,
        )

        taker = instance.acquire(KEY, ttl=NEW_TTL)
        assert taker is not None, "the expired lease should be free to take over"
        assert slot_of(taker) == slot, "the taker should get the expired slot"
        before = side.record(slot)
        assert before.token == taker.token

        child.go_on()
        results = child.finish("results", STEP_TIMEOUT)

    after = side.record(slot)
    assert isinstance(results, dict)
    assert set(results) == set(CALLS)
    problems = [
        f"{call} returned {results[call]!r}" for call in CALLS if results[call] is not False
    ]
    if after.token != taker.token:
        problems.append(f"the new holder's token became {after.token!r}")
    if case.backend == "redis":
        # PTTL only falls as time passes; a stale extend would raise it to ~60 s.
        assert isinstance(before.expiry, float)
        if not isinstance(after.expiry, float) or not 0 < after.expiry <= before.expiry:
            problems.append(f"PTTL went from {before.expiry} to {after.expiry} ms")
    elif after.expiry != before.expiry:
        problems.append(f"the expiry went from {before.expiry} to {after.expiry}")
    if filler is not None:
        if side.record(slot_of(filler)).token != filler.token:
            problems.append("the other permit's record lost its token")
        assert filler.release() is True
    assert not problems, f"{case.id}: " + "; ".join(problems)
    assert taker.release() is True
