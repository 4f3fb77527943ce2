"""The backends the contract suite runs against: one case per backend, client package and face.

Each case is a :class:`~tests._support.backends.Rig` over a backend of
``tests/_support/backends.py``. Later backends add a case here; the tests in
this folder do not change.

Redis cases: every client package of ``tests/_support/redis_clients.py`` on
the newest server found, fakeredis, and redis-py on every other server
version found (see ``tests/_support/redis_servers.py``).

PostgreSQL cases (``tests/_support/postgres_servers.py``): psycopg 3 and a
psycopg_pool pool on each face, asyncpg (asyncio only), psycopg (each
face) and asyncpg through PgBouncer in transaction mode, and SQLAlchemy
engines: on psycopg (each face) and asyncpg (asyncio).
``DMUTEX_POSTGRESQL_VARIANTS`` (comma-separated) runs a subset of them:
``.ci/run`` runs the pooler's on one interpreter only, since what
PgBouncer does to a session depends on no interpreter.

MySQL cases (``tests/_support/mysql_backend.py``, on the server of
``tests/_support/mysql_servers.py``): PyMySQL (in autocommit and out of it),
mysqlclient, mysql-connector and its pool, a SQLAlchemy Engine (sync);
aiomysql and asyncmy connections and pools, a SQLAlchemy AsyncEngine
(asyncio). ``DMUTEX_MYSQL_VARIANTS`` runs a subset.

etcd cases (``tests/_support/etcd_backend.py``, on the member of
``tests/_support/etcd_servers.py``): etcd3gw (sync) and aetcd (asyncio).

DynamoDB cases (``tests/_support/dynamodb_backend.py``): boto3 (sync) and
aiobotocore (asyncio), on each server ``tests/_support/dynamodb_servers.py``
finds: moto's server and dynalite (neither is DynamoDB), or the endpoint
``DMUTEX_DYNAMODB_URL`` names in moto's place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests._support import dynamodb_servers
from tests._support.backends import (
    POSTGRES_VARIANTS,
    Backend,
    FakeRedis,
    Memory,
    Mongomock,
    Postgres,
    RealMongo,
    RealRedis,
    Rig,
    SQLite,
)
from tests._support.dynamodb_backend import Dynamo
from tests._support.dynamodb_servers import Session as DynamoSession
from tests._support.etcd_backend import Etcd
from tests._support.etcd_servers import Session as EtcdSession
from tests._support.etcd_servers import etcd_label
from tests._support.faces import FaceName
from tests._support.mongo_servers import Session as MongoSession
from tests._support.mongo_servers import mongo_label
from tests._support.mysql_backend import MYSQL_CASES, MYSQL_VARIANTS, MySQL, chosen_variants
from tests._support.mysql_servers import Session as MySQLSession
from tests._support.mysql_servers import mysql_label
from tests._support.postgres_servers import Session as PostgresSession
from tests._support.postgres_servers import postgres_label
from tests._support.redis_clients import SERVER_VARIANTS
from tests._support.redis_servers import Pool, discovered, server_or_skip


@dataclass
class Servers:
    """The real servers a case may need; each starts (or skips) on first use."""

    redis: Pool
    mongo: MongoSession
    postgres: PostgresSession
    mysql: MySQLSession
    etcd: EtcdSession
    dynamodb: DynamoSession


Case = Callable[[Servers], Backend]


def _redis_case(label: str, variant: str) -> Case:
    def make(servers: Servers) -> Backend:
        return RealRedis(server_or_skip(servers.redis, label).url, variant)

    return make


def _dynamodb_case(kind: str) -> Case:
    def make(servers: Servers) -> Backend:
        session = servers.dynamodb
        return Dynamo(session.server(kind), session.prefix)

    return make


def _postgres_case(variant: str) -> Case:
    return lambda servers: Postgres(servers.postgres, variant)


def _mysql_case(variant: str) -> Case:
    return lambda servers: MySQL(servers.mysql, variant)


# PostgreSQL clients per face: asyncpg has no sync client.
POSTGRES_CASES: dict[FaceName, tuple[str, ...]] = {
    "sync": ("psycopg", "psycopg-pool", "psycopg-pgbouncer", "sqlalchemy-psycopg"),
    "async": POSTGRES_VARIANTS,  # each has an asyncio client
}


def _postgres_variants() -> frozenset[str]:
    """``DMUTEX_POSTGRESQL_VARIANTS``: a comma-separated subset of the variants to run (all)."""
    chosen = os.environ.get("DMUTEX_POSTGRESQL_VARIANTS", "").strip()
    if not chosen:
        return frozenset(POSTGRES_VARIANTS)
    names = frozenset(name.strip() for name in chosen.split(","))
    unknown = sorted(names - set(POSTGRES_VARIANTS))
    if unknown:
        raise ValueError(
            f"DMUTEX_POSTGRESQL_VARIANTS names {unknown}; the variants are {POSTGRES_VARIANTS}"
        )
    return names


def _cases() -> dict[str, tuple[FaceName, Case]]:
    labels = discovered().labels or [""]  # "": skip with discovery's reason
    newest, others = labels[-1], labels[:-1]
    cases: dict[str, tuple[FaceName, Case]] = {}
    faces: tuple[FaceName, ...] = ("sync", "async")
    for face in faces:
        cases[f"memory-{face}"] = (face, lambda servers: Memory())
        cases[f"fakeredis-{face}"] = (face, lambda servers: FakeRedis())
        cases[f"mongomock-{face}"] = (face, lambda servers: Mongomock())
        cases[f"sqlite-{face}"] = (face, lambda servers: SQLite())
        cases[f"pymongo-{face}@{mongo_label()}"] = (face, lambda servers: RealMongo(servers.mongo))
        for variant in SERVER_VARIANTS:
            label = newest or "no-server"
            cases[f"{variant}-{face}@{label}"] = (face, _redis_case(newest, variant))
        for label in others:
            cases[f"redis-py-{face}@{label}"] = (face, _redis_case(label, "redis-py"))
        for variant in POSTGRES_CASES[face]:
            if variant not in _postgres_variants():
                continue
            cases[f"{variant}-{face}@{postgres_label()}"] = (face, _postgres_case(variant))
        for variant in MYSQL_CASES[face]:
            if variant in chosen_variants():
                cases[f"{variant}-{face}@{mysql_label()}"] = (face, _mysql_case(variant))
        client = ETCD_CLIENTS[face]
        cases[f"{client}-{face}@{etcd_label()}"] = (face, lambda servers: Etcd(servers.etcd))
        for kind in dynamodb_servers.kinds():
            label = dynamodb_servers.label(kind)
            cases[f"{DYNAMODB_CLIENTS[face]}-{face}@{label}"] = (face, _dynamodb_case(kind))
    return cases


# etcd clients per face: etcd3gw is sync only, aetcd asyncio only.
ETCD_CLIENTS: dict[FaceName, str] = {"sync": "etcd3gw", "async": "aetcd"}
# DynamoDB clients per face: botocore's through boto3, and aiobotocore's.
DYNAMODB_CLIENTS: dict[FaceName, str] = {"sync": "boto3", "async": "aiobotocore"}


CASES = _cases()
MANUAL_CLOCK_CASES = (
    "memory-async",
    "memory-sync",
    "mongomock-async",
    "mongomock-sync",
    "sqlite-async",
    "sqlite-sync",
)


# The cases whose backend serves read-write locks (the ``rw_env`` fixture's),
# by the start of the case's name.
READ_WRITE_BACKENDS = (
    "memory-",
    "sqlite-",
    "fakeredis-",
    "redis-py-",
    "valkey-py-",
    "set-eval-",
    "mongomock-",
    "pymongo-",
    *(f"{variant}-" for variant in POSTGRES_VARIANTS),
    *(f"{variant}-" for variant in MYSQL_VARIANTS),
    *(f"{client}-" for client in ETCD_CLIENTS.values()),
    *(f"{client}-" for client in DYNAMODB_CLIENTS.values()),
)


def read_write(name: str) -> bool:
    """Whether case ``name``'s backend serves read-write locks."""
    return name.startswith(READ_WRITE_BACKENDS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that move time (``manual_clock`` mark) run on the ManualClock cases only.

    ``rw_env`` is ``env`` on the cases whose backend serves read-write locks.
    """
    for fixture, chosen in (("env", CASES), ("rw_env", [n for n in CASES if read_write(n)])):
        if fixture in metafunc.fixturenames:
            moves_time = metafunc.definition.get_closest_marker("manual_clock") is not None
            names = [n for n in MANUAL_CLOCK_CASES if n in chosen] if moves_time else chosen
            metafunc.parametrize(fixture, sorted(names), indirect=True)


@contextlib.contextmanager
def _rig(name: str, servers: Servers) -> Iterator[Rig]:
    face, case = CASES[name]
    rig = Rig(case(servers), face)
    try:
        yield rig
    finally:
        rig.close()


@pytest.fixture
def rw_env(
    request: pytest.FixtureRequest,
    redis_pool: Pool,
    mongo_session: MongoSession,
    postgres_session: PostgresSession,
    mysql_session: MySQLSession,
    etcd_session: EtcdSession,
    dynamodb_session: DynamoSession,
) -> Iterator[Rig]:
    """``env``, on a case whose backend serves read-write locks."""
    servers = Servers(
        redis_pool, mongo_session, postgres_session, mysql_session, etcd_session, dynamodb_session
    )
    with _rig(request.param, servers) as rig:
        yield rig


@pytest.fixture
def env(
    request: pytest.FixtureRequest,
    redis_pool: Pool,
    mongo_session: MongoSession,
    postgres_session: PostgresSession,
    mysql_session: MySQLSession,
    etcd_session: EtcdSession,
    dynamodb_session: DynamoSession,
) -> Iterator[Rig]:
    servers = Servers(
        redis_pool, mongo_session, postgres_session, mysql_session, etcd_session, dynamodb_session
    )
    with _rig(request.param, servers) as rig:
        yield rig
