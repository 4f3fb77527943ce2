"""Every bad input raises the stated error before any I/O (the README's "Bad input").

Constructor rows use client doubles that record any call; operation rows use
a Redis-shaped double that records every command and answers as a free
server would. After each bad call, the record must be empty.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import fakeredis
import psycopg_pool
import pytest

from dmutex import (
    MAX_PERMITS,
    AmbiguousClientError,
    AsyncDMutex,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    DMutex,
    DMutexError,
    DReadWriteLock,
    DSemaphore,
    InMemoryBackend,
    InvalidArgumentError,
    ManualClock,
    SQLiteBackend,
    UnsupportedClientError,
)
from dmutex._cli.holders import Reader
from tests._support.doubles import (
    AnsweringRedis,
    AsyncAnsweringRedis,
    AsyncRecordingMySQL,
    AsyncRecordingPsycopg,
    RecordingAsyncpg,
    RecordingBoth,
    RecordingMongo,
    RecordingMySQL,
    RecordingPsycopg,
    RecordingRedis,
    RecordingRedisPsycopg,
)

CLASSES: list[Any] = [DMutex, DSemaphore, AsyncDMutex, AsyncDSemaphore]
BAD_SECONDS: list[Any] = [  # (value, error) pairs
    (True, TypeError),
    (False, TypeError),
    ("5", TypeError),
    (b"5", TypeError),
    (0, ValueError),
    (0.0, ValueError),
    (-1, ValueError),
    (math.nan, ValueError),
    (math.inf, ValueError),
    (-math.inf, ValueError),
    (1e12, ValueError),  # expiry past the year 9999: no backend can store it
    (1e306, ValueError),  # so large that seconds * 1000 overflows a float
    # Beyond the largest float: float() overflows (issue 10, hole 6).
    (10**400, ValueError),
    (-(10**400), ValueError),
    (Fraction(10**400, 3), ValueError),
    pytest.param(10**5000, ValueError, id="10**5000"),  # too many digits for int -> str
    (Decimal("1.5"), TypeError),  # not a numbers.Real
]


def make(cls: Any, client: object, **options: Any) -> Any:
    if cls in (DSemaphore, AsyncDSemaphore):
        options.setdefault("max_permits", 2)
    return cls("svc", client, **options)


def resolve(value: Any) -> Any:
    """Run a coroutine to completion; return anything else as it is."""
    if asyncio.iscoroutine(value):
        return asyncio.run(value)
    return value


def check_error(error: type[Exception], call: Callable[[], object], calls: list[Any]) -> None:
    with pytest.raises(error) as raised:
        resolve(call())
    assert isinstance(raised.value, DMutexError)
    assert calls == [], f"a call reached the client: {calls}"


# --- constructor rows -------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("value", "error"), BAD_SECONDS)
def test_default_ttl_seconds(cls: Any, value: object, error: type[Exception]) -> None:
    client = RecordingRedis()
    check_error(error, lambda: make(cls, client, default_ttl_seconds=value), client.calls)


@pytest.mark.parametrize("cls", [DSemaphore, AsyncDSemaphore])
@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-3, ValueError),
        (True, TypeError),
        (2.0, TypeError),
        ("2", TypeError),
        (None, TypeError),
        # An upper bound, so that no script blocks Redis for long (hole 5).
        (MAX_PERMITS + 1, ValueError),
        pytest.param(10**400, ValueError, id="10**400"),
        pytest.param(10**5000, ValueError, id="10**5000"),
    ],
)
def test_max_permits(cls: Any, value: object, error: type[Exception]) -> None:
    client = RecordingRedis()
    check_error(error, lambda: cls("svc", client, max_permits=value), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("value", "error"),
    [("", ValueError), (None, TypeError), (7, TypeError), ("a\ud800", ValueError)],
)
def test_service_name(cls: Any, value: object, error: type[Exception]) -> None:
    """Also a name that UTF-8 cannot encode (a lone surrogate), whichever backend."""
    client = RecordingRedis()
    options: dict[str, Any] = {"max_permits": 1} if cls in (DSemaphore, AsyncDSemaphore) else {}
    check_error(error, lambda: cls(value, client, **options), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "options",
    [
        {"service_name": "a$b"},
        {"service_name": "nul\x00"},
        {"collection_prefix": "system."},
        {"collection_name": ""},
        {"collection_name": "x$y"},
        {"db_name": ""},
        {"db_name": "a.b"},
        {"db_name": "a/b"},
        {"db_name": "x" * 64},
        # What pymongo's own checks refuse later, as InvalidName (hole 6).
        {"service_name": "a."},
        {"service_name": "a..b"},
        {"collection_name": ".x"},
        {"collection_name": "x."},
        # A namespace f"{db}.{collection}" over MongoDB's 255 bytes.
        {"service_name": "s" * 300},
        {"collection_name": "c" * 249},
        {"collection_name": "é" * 125},
    ],
)
def test_invalid_mongodb_names(cls: Any, options: dict[str, Any]) -> None:
    client = RecordingMongo()
    options = dict(options)
    service = options.pop("service_name", "svc")
    extra: dict[str, Any] = {"max_permits": 1} if cls in (DSemaphore, AsyncDSemaphore) else {}
    check_error(ValueError, lambda: cls(service, client, **options, **extra), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "value", ["MySQL", "mariadb", "Redis", "", 1, True, "postgres", "PostgreSQL"]
)
def test_backend_name(cls: Any, value: object) -> None:
    client = RecordingRedis()
    check_error(ValueError, lambda: make(cls, client, backend=value), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("client", [object(), "redis://localhost", 42, None])
def test_client_matching_no_contract(cls: Any, client: object) -> None:
    with pytest.raises(UnsupportedClientError) as raised:
        make(cls, client)
    message = str(raised.value)
    assert "get_database" in message
    assert "execute_command" in message
    assert "set(" in message
    assert "eval(" in message


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("double", "said"),
    [
        (RecordingBoth, "backend="),
        (RecordingRedisPsycopg, "backend='postgresql' or backend='redis'"),
    ],
)
def test_client_matching_both_contracts(cls: Any, double: Any, said: str) -> None:
    """Ambiguous without ``backend=``, which the error names."""
    client = double()
    check_error(AmbiguousClientError, lambda: make(cls, client), client.calls)
    with pytest.raises(TypeError, match=said):
        make(cls, client)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("client", "backend"), [(RecordingRedis(), "mongodb"), (RecordingMongo(), "redis")]
)
def test_backend_naming_an_unmet_contract(cls: Any, client: Any, backend: str) -> None:
    client.calls.clear()
    check_error(UnsupportedClientError, lambda: make(cls, client, backend=backend), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "option",
    ["db_name", "collection_prefix", "key_prefix", "table_prefix", "schema_name", "database_name"],
)
def test_option_types(cls: Any, option: str) -> None:
    client = RecordingRedis()
    check_error(TypeError, lambda: make(cls, client, **{option: 5}), client.calls)


# --- PostgreSQL ---------------------------------------------------------------------

SYNC_CLASSES: list[Any] = [DMutex, DSemaphore]
ASYNC_CLASSES: list[Any] = [AsyncDMutex, AsyncDSemaphore]


def recording_psycopg(cls: Any) -> RecordingPsycopg:
    """A psycopg-shaped double of ``cls``'s face that records any call."""
    return AsyncRecordingPsycopg() if cls in ASYNC_CLASSES else RecordingPsycopg()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("options", "error", "said"),
    [
        ({"table_name": ""}, ValueError, "table_name"),
        ({"table_name": "a\x00b"}, ValueError, "NUL"),
        ({"table_name": 5}, TypeError, "table_name"),
        ({"schema_name": ""}, ValueError, "schema_name"),
        ({"schema_name": "s\x00"}, ValueError, "NUL"),
        ({"schema_name": 5}, TypeError, "schema_name"),
        ({"schema_name": b"s"}, TypeError, "schema_name"),
        ({"schema_name": "a\ud800"}, ValueError, "UTF-8"),
        # PostgreSQL would cut a name over 63 bytes short.
        ({"schema_name": "s" * 64}, ValueError, "64 bytes"),
        ({"schema_name": "é" * 32}, ValueError, "64 bytes"),
        # The index "<table>_expired_at_idx" must fit in 63 bytes too: 48 for the table.
        ({"table_name": "t" * 49}, ValueError, "at most 48 bytes"),
        ({"table_name": "é" * 25}, ValueError, "at most 48 bytes"),
        ({"table_prefix": "p" * 49}, ValueError, "table_prefix"),
        ({"service_name": "s" * 41}, ValueError, "service_name"),
    ],
)
def test_invalid_postgresql_names(
    cls: Any, options: dict[str, Any], error: type[Exception], said: str
) -> None:
    client = recording_psycopg(cls)
    options = dict(options)
    service = options.pop("service_name", "svc")
    extra: dict[str, Any] = {"max_permits": 1} if cls in (DSemaphore, AsyncDSemaphore) else {}
    with pytest.raises(error, match=said):
        cls(service, client, **options, **extra)
    check_error(error, lambda: cls(service, client, **options, **extra), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
def test_longest_postgresql_names_are_accepted(cls: Any) -> None:
    """The limits are the server's: a 48-byte table and a 63-byte schema build, with no call."""
    client = recording_psycopg(cls)
    made = make(cls, client, table_name="t" * 48, schema_name="s" * 63)
    assert isinstance(made, cls)
    assert client.calls == []


def asyncio_postgres_clients() -> list[Any]:
    """asyncio PostgreSQL clients that no call may reach: doubles, and real pools never opened."""
    return [
        AsyncRecordingPsycopg(),
        RecordingAsyncpg(),
        psycopg_pool.AsyncConnectionPool("postgresql://nobody@127.0.0.1:1/none", open=False),
    ]


@pytest.mark.parametrize("cls", SYNC_CLASSES)
@pytest.mark.parametrize("index", range(3))
def test_asyncio_postgresql_client_refused_by_sync_classes(cls: Any, index: int) -> None:
    """Its face is known from its type: refused at construction, before any call."""
    client = asyncio_postgres_clients()[index]
    with pytest.raises(UnsupportedClientError, match="use AsyncDMutex / AsyncDSemaphore"):
        make(cls, client)
    assert getattr(client, "calls", []) == []


@pytest.mark.parametrize("cls", ASYNC_CLASSES)
def test_sync_postgresql_pool_refused_by_async_classes(cls: Any) -> None:
    """psycopg's sync API does its I/O before it returns: refused at construction."""
    client = psycopg_pool.ConnectionPool("postgresql://nobody@127.0.0.1:1/none", open=False)
    with pytest.raises(UnsupportedClientError, match="use DMutex / DSemaphore"):
        make(cls, client)


@pytest.mark.parametrize("cls", CLASSES)
def test_sqlite3_connection_is_not_a_postgresql_client(cls: Any) -> None:
    """It has ``execute`` (and ``autocommit`` on 3.12+), but not psycopg's ``info``."""
    conn = sqlite3.connect(":memory:")
    try:
        with pytest.raises(UnsupportedClientError, match="SQLiteBackend") as raised:
            make(cls, conn)
        assert "a PostgreSQL client needs" in str(raised.value)
        with pytest.raises(UnsupportedClientError, match="backend='postgresql'"):
            make(cls, conn, backend="postgresql")
    finally:
        conn.close()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("client", "backend"),
    [(RecordingRedis(), "postgresql"), (RecordingMongo(), "postgresql")],
)
def test_backend_postgresql_naming_an_unmet_contract(cls: Any, client: Any, backend: str) -> None:
    client.calls.clear()
    check_error(UnsupportedClientError, lambda: make(cls, client, backend=backend), client.calls)
    with pytest.raises(UnsupportedClientError, match="fetch"):
        make(cls, client, backend=backend)


@pytest.mark.parametrize("cls", SYNC_CLASSES)
def test_backend_chooses_between_the_redis_and_the_postgresql_contract(cls: Any) -> None:
    """Either choice builds, with no call."""
    client = RecordingRedisPsycopg()
    for backend in ("postgresql", "redis"):
        assert isinstance(make(cls, client, backend=backend), cls)
    assert client.calls == []


@pytest.mark.parametrize("cls", CLASSES)
def test_postgresql_names_are_not_judged_for_other_backends(cls: Any) -> None:
    """A table or schema name PostgreSQL would refuse is ignored by Redis, as the README says."""
    client = RecordingRedis()
    made = make(cls, client, table_name="t" * 100, schema_name="s" * 100)
    assert isinstance(made, cls)
    assert client.calls == []


# --- MySQL ------------------------------------------------------------------------


def recording_mysql(cls: Any) -> RecordingMySQL:
    """A MySQL-shaped double of ``cls``'s face that records any call."""
    return AsyncRecordingMySQL() if cls in ASYNC_CLASSES else RecordingMySQL()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("options", "error", "said"),
    [
        ({"table_name": ""}, ValueError, "table_name"),
        ({"table_name": "a\x00b"}, ValueError, "NUL"),
        ({"table_name": "t "}, ValueError, "end with a space"),
        ({"table_name": "t" * 65}, ValueError, "65 characters, over MySQL's 64"),
        ({"table_prefix": "p" * 62}, ValueError, "table_prefix"),
        ({"database_name": ""}, ValueError, "database_name"),
        ({"database_name": "d\x00"}, ValueError, "NUL"),
        ({"database_name": "d" * 65}, ValueError, "over MySQL's 64"),
        ({"database_name": 5}, TypeError, "database_name"),
        ({"database_name": b"d"}, TypeError, "database_name"),
        ({"database_name": "a\ud800"}, ValueError, "UTF-8"),
    ],
)
def test_invalid_mysql_names(
    cls: Any, options: dict[str, Any], error: type[Exception], said: str
) -> None:
    client = recording_mysql(cls)
    extra: dict[str, Any] = {"max_permits": 1} if cls in (DSemaphore, AsyncDSemaphore) else {}
    with pytest.raises(error, match=said):
        cls("svc", client, **options, **extra)
    check_error(error, lambda: cls("svc", client, **options, **extra), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
def test_longest_mysql_names_are_accepted(cls: Any) -> None:
    """64 characters, 4-byte ones included: the server's limit counts characters."""
    client = recording_mysql(cls)
    made = make(cls, client, table_name="\U0001f512" * 64, database_name="d" * 64)
    assert isinstance(made, cls)
    assert client.calls == []


@pytest.mark.parametrize("cls", SYNC_CLASSES)
def test_asyncio_mysql_client_refused_by_sync_classes_before_any_call(cls: Any) -> None:
    """Its ``commit`` is a coroutine function. (A sync client of a package dmutex does not
    know reaches an asyncio class's first call, which refuses its plain answer.)"""
    client = AsyncRecordingMySQL()
    check_error(UnsupportedClientError, lambda: make(cls, client), client.calls)


# --- replicas= (Redis) --------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("options", "error", "said"),
    [
        ({"replicas": -1}, ValueError, "from 0 to 64"),
        ({"replicas": 65}, ValueError, "from 0 to 64"),
        ({"replicas": 2**70}, ValueError, "an int of 71 bits"),
        ({"replicas": True}, TypeError, "replicas must be an int"),
        ({"replicas": 1.0}, TypeError, "replicas must be an int"),
        ({"replicas": "1"}, TypeError, "replicas must be an int"),
        ({"replicas_timeout": 0}, ValueError, "replicas_timeout must be > 0"),
        ({"replicas_timeout": -0.5}, ValueError, "replicas_timeout must be > 0"),
        ({"replicas_timeout": math.nan}, ValueError, "finite"),
        ({"replicas_timeout": math.inf}, ValueError, "finite"),
        ({"replicas_timeout": 86_401}, ValueError, "at most 86400"),
        ({"replicas_timeout": True}, TypeError, "replicas_timeout"),
        ({"replicas_timeout": "1"}, TypeError, "replicas_timeout"),
    ],
)
def test_invalid_replicas(
    cls: Any, options: dict[str, Any], error: type[Exception], said: str
) -> None:
    """Checked whatever the backend, before any call."""
    client = RecordingRedis()
    with pytest.raises(error, match=said):
        make(cls, client, **options)
    check_error(error, lambda: make(cls, client, **options), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("double", "said"),
    [
        (lambda cls: RecordingMongo(), "w='majority', j=True"),
        (recording_psycopg, "synchronous replication"),
        (recording_mysql, "semi-synchronous replication"),
    ],
    ids=["mongodb", "postgresql", "mysql"],
)
def test_replicas_on_a_backend_that_replicates_by_its_own_settings(
    cls: Any, double: Callable[[Any], Any], said: str
) -> None:
    """An error that says what to set instead: silence would promise what it does not do."""
    client = double(cls)
    with pytest.raises(ValueError, match=said):
        make(cls, client, replicas=1)
    check_error(InvalidArgumentError, lambda: make(cls, client, replicas=1), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
def test_replicas_on_a_redis_client_that_cannot_pipeline(cls: Any) -> None:
    """A WAIT sent on its own might reach another connection than the write: refused."""
    client = RecordingRedis()
    with pytest.raises(TypeError, match="replicas= needs a Redis client that pipelines"):
        make(cls, client, replicas=1)
    check_error(UnsupportedClientError, lambda: make(cls, client, replicas=1), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
def test_replicas_accepted_by_the_in_process_backends(cls: Any, tmp_path: Path) -> None:
    """They have no replicas to wait for; code that sets it from its configuration runs on them."""
    assert isinstance(make(cls, InMemoryBackend(), replicas=2), cls)
    backend = SQLiteBackend(str(tmp_path / "locks.db"))
    try:
        assert isinstance(make(cls, backend, replicas=2, replicas_timeout=0.001), cls)
    finally:
        backend.close()


# --- operation rows ---------------------------------------------------------------


BAD_KEYS: list[tuple[object, type[Exception]]] = [
    ("", ValueError),
    (None, TypeError),
    (5, TypeError),
    (b"key", TypeError),
    ("\ud800", ValueError),  # UTF-8 cannot encode it; it failed inside the client
    ("ok\udfff", ValueError),
    ("k" * 501, ValueError),  # past what every layout stores (MAX_KEY_LENGTH)
    ("é" * 501, ValueError),  # characters, not bytes
]


def operations(target: Any, key: Any = "k", ttl: Any = None) -> dict[str, Callable[[], object]]:
    """Every public operation that takes a key and a ttl, called with these."""
    token = "00000000-0000-4000-8000-000000000000"
    ops: dict[str, Callable[[], object]] = {
        "acquire": lambda: target.acquire(key, ttl),
        "acquire_with_retry": lambda: target.acquire_with_retry(key, ttl=ttl, timeout=0),
        "run": lambda: target.run(key, print, ttl),
        "run_with_retry": lambda: target.run_with_retry(key, print, ttl=ttl, timeout=0),
        "extend": lambda: target.extend(key, token, ttl),
    }
    if isinstance(target, (DMutex, AsyncDMutex)):
        ops["lock"] = lambda: target.lock(key, ttl)
    return ops


def recorded(cls: Any) -> tuple[Any, AnsweringRedis]:
    client = AsyncAnsweringRedis() if cls in (AsyncDMutex, AsyncDSemaphore) else AnsweringRedis()
    return make(cls, client, clock=ManualClock()), client


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("key", "error"), BAD_KEYS)
def test_key(cls: Any, key: Any, error: type[Exception]) -> None:
    target, client = recorded(cls)
    calls = [*operations(target, key=key).values()]
    if isinstance(target, (DSemaphore, AsyncDSemaphore)):
        calls.append(lambda: target.release(key, "t"))
    else:
        calls.append(lambda: target.unlock(key, "t"))
        calls.append(lambda: target.unlock(key))
    for call in calls:
        check_error(error, call, client.calls)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("ttl", "error"), BAD_SECONDS)
def test_ttl(cls: Any, ttl: object, error: type[Exception]) -> None:
    target, client = recorded(cls)
    for call in operations(target, ttl=ttl).values():
        check_error(error, call, client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("ttl", "error"), BAD_SECONDS)
def test_handle_extend_ttl(cls: Any, ttl: object, error: type[Exception]) -> None:
    target, client = recorded(cls)
    handle = resolve(target.acquire("k"))
    client.calls.clear()
    check_error(error, lambda: handle.extend(ttl), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"timeout": -0.001}, ValueError),
        ({"timeout": math.nan}, ValueError),
        ({"timeout": math.inf}, ValueError),
        ({"timeout": True}, TypeError),
        ({"timeout": "1"}, TypeError),
        ({"retry_delay": 0}, ValueError),
        ({"retry_delay": -1}, ValueError),
        ({"retry_delay": math.nan}, ValueError),
        ({"retry_delay": math.inf}, ValueError),
        ({"retry_delay": None}, TypeError),
    ],
)
def test_timeout_and_retry_delay(cls: Any, options: dict[str, Any], error: type[Exception]) -> None:
    target, client = recorded(cls)
    check_error(error, lambda: target.acquire_with_retry("k", **options), client.calls)
    check_error(error, lambda: target.run_with_retry("k", print, **options), client.calls)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("token", "error"), [("", ValueError), (None, TypeError), (7, TypeError)])
def test_token(cls: Any, token: Any, error: type[Exception]) -> None:
    target, client = recorded(cls)
    check_error(error, lambda: target.extend("k", token), client.calls)
    if isinstance(target, (DSemaphore, AsyncDSemaphore)):
        check_error(error, lambda: target.release("k", token), client.calls)
    elif token is not None:  # unlock(key, None) means "the remembered token"
        check_error(error, lambda: target.unlock("k", token), client.calls)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("callback", [None, "print", 3])
def test_callback_not_callable(cls: Any, callback: object) -> None:
    target, client = recorded(cls)
    check_error(TypeError, lambda: target.run("k", callback), client.calls)
    check_error(TypeError, lambda: target.run_with_retry("k", callback), client.calls)


def test_a_recording_backend_does_record() -> None:
    """The doubles above would notice a call: a good one is recorded."""
    target, client = recorded(DMutex)
    target.acquire("k")
    assert client.count("EVALSHA") == 1


@pytest.mark.parametrize("cls", CLASSES)
def test_mongodb_names_are_not_judged_for_other_backends(cls: Any) -> None:
    """Options of the other backend are ignored, as the README says."""
    client = RecordingRedis()
    made = make(cls, client, db_name="", collection_name="a$b", collection_prefix="system.")
    assert isinstance(made, cls)
    assert client.calls == []


# --- NUL on PostgreSQL ------------------------------------------------------------

RW_CLASSES: list[Any] = [DReadWriteLock, AsyncDReadWriteLock]


def postgres_clients(cls: Any) -> list[Any]:
    """PostgreSQL doubles of ``cls``'s face that record every call and answer none."""
    if cls in (*ASYNC_CLASSES, AsyncDReadWriteLock):
        return [AsyncRecordingPsycopg(), RecordingAsyncpg()]
    return [RecordingPsycopg()]


def key_operations(cls: Any, target: Any, key: str, token: str) -> dict[str, Callable[[], object]]:
    """Every public operation of ``cls`` that sends ``key`` (and ``token``, where one is given)."""
    if cls in RW_CLASSES:
        return {
            "acquire_read": lambda: target.acquire_read(key),
            "acquire_write": lambda: target.acquire_write(key),
            "acquire_read_with_retry": lambda: target.acquire_read_with_retry(key, timeout=0),
            "acquire_write_with_retry": lambda: target.acquire_write_with_retry(key, timeout=0),
            "run_read": lambda: target.run_read(key, print),
            "run_write": lambda: target.run_write(key, print),
            "run_read_with_retry": lambda: target.run_read_with_retry(key, print, timeout=0),
            "run_write_with_retry": lambda: target.run_write_with_retry(key, print, timeout=0),
            "release": lambda: target.release(key, token),
            "extend": lambda: target.extend(key, token),
        }
    ops = operations(target, key=key)
    ops["extend"] = lambda: target.extend(key, token)
    if cls in (DMutex, AsyncDMutex):
        ops["unlock"] = lambda: target.unlock(key, token)
    else:
        ops["release"] = lambda: target.release(key, token)
    return ops


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cls", [*CLASSES, *RW_CLASSES])
@pytest.mark.parametrize("key", ["a\x00b", "\x00", "k\x00"])
def test_a_key_with_nul_is_refused_on_postgresql_before_any_call(cls: Any, key: str) -> None:
    """PostgreSQL text holds no NUL: psycopg and asyncpg failed at the send, the table made."""
    for client in postgres_clients(cls):
        target = make(cls, client)
        token = "00000000-0000-4000-8000-000000000000"
        for name, call in key_operations(cls, target, key, token).items():
            with pytest.raises(InvalidArgumentError, match="NUL character") as raised:
                resolve(call())
            assert "PostgreSQL" in str(raised.value), name
            assert client.calls == [], f"{name}: a call reached {type(client).__name__}"


def token_operations(cls: Any, target: Any, token: str) -> list[Callable[[], object]]:
    """Extend and release (``unlock``, DMutex's only one) by ``token``."""
    calls: list[Callable[[], object]] = [lambda: target.extend("k", token)]
    if cls in (DMutex, AsyncDMutex):
        calls.append(lambda: target.unlock("k", token))
    else:
        calls.append(lambda: target.release("k", token))
    return calls


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cls", [*CLASSES, *RW_CLASSES])
def test_a_token_with_nul_is_refused_on_postgresql_before_any_call(cls: Any) -> None:
    """Release and extend by token send the token as text: refused as a key is."""
    for client in postgres_clients(cls):
        for call in token_operations(cls, make(cls, client), "t\x00"):
            with pytest.raises(InvalidArgumentError, match="token 't\\\\x00' contains a NUL"):
                resolve(call())
            assert client.calls == []


def test_the_status_reader_refuses_a_key_with_nul_on_postgresql_before_any_call() -> None:
    for readwrite in (False, True):
        client = RecordingPsycopg()
        reader = Reader(client, service="svc", limit=1, readwrite=readwrite)
        with pytest.raises(InvalidArgumentError, match="NUL character"):
            reader.holders("a\x00b")
        assert client.calls == []


@pytest.mark.parametrize("cls", [DMutex, DSemaphore, DReadWriteLock])
def test_a_key_with_nul_is_a_lock_of_its_own_where_the_server_holds_it(
    cls: Any, tmp_path: Path
) -> None:
    """SQLite, Redis (fakeredis) and InMemoryBackend hold NUL: the key is not refused there.

    MySQL and MariaDB too (``tests/integration/test_mysql_store.py``); MongoDB
    keeps keys as BSON strings, which may hold NUL.
    """
    sqlite = SQLiteBackend(tmp_path / "locks.sqlite3")
    redis_client = fakeredis.FakeRedis()
    try:
        for client in (sqlite, redis_client, InMemoryBackend()):
            lock = make(cls, client)
            take = lock.acquire_write if cls is DReadWriteLock else lock.acquire
            first, second = take("a\x00b"), take("ab")
            assert first is not None, type(client).__name__
            assert second is not None, "another lock"
            assert first.key == "a\x00b"
            assert first.release() is True
            assert second.release() is True
    finally:
        sqlite.close()
        redis_client.close()
