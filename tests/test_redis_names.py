"""Redis key prefixes: no namespace's record names can be another's (``check_redis_prefix``).

Every Redis record is ``prefix + kind + ":" + rest`` (``rest`` the key, or
``f"{slot}:{key}"`` for a slot key), the prefix ``key_prefix`` or, by
default, ``f"_dmutex_{service}:"`` (``_dsemaphore_``, ``_drwlock_``). A
service name with a ``:``-separated part that is a kind word would reach
another's records: service ``x:permit:0``'s key ``k`` is service ``x``'s key
``permit:0:k``. These tests hold the rule that refuses such names:

- the cases found are refused at construction, by every face, before any
  call reaches the client, with the library's ``InvalidArgumentError``;
- names next to them (a kind word as a service's first part, inside a
  part, as a key prefix's last part) are accepted, and the rule is Redis's
  only;
- a Hypothesis search over namespaces built from the kind words, slot
  numbers and separators: for any record name of an accepted namespace,
  every other way to read that name as ``prefix + kind + ":" + rest``
  (another prefix ending at any ``:`` of it) gives a namespace that is
  refused or the very same record. The names are the stores' own (opened
  as the faces open them), checked against the layout as they are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dmutex import (
    AsyncDMutex,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    DMutex,
    DReadWriteLock,
    DSemaphore,
    InMemoryBackend,
    InvalidArgumentError,
    SQLiteBackend,
)
from dmutex._backends import open_readwrite_store, open_store
from dmutex._backends.redis import RedisReadWriteStore, RedisStore
from dmutex._backends.redis.names import REDIS_KINDS
from dmutex._clock import SYSTEM_CLOCK
from dmutex._options import DEFAULT_PREFIX, Kind, Options
from dmutex._validate import check_key
from tests._support.doubles import RecordingRedis

CLASSES: list[Any] = [
    DMutex,
    DSemaphore,
    DReadWriteLock,
    AsyncDMutex,
    AsyncDSemaphore,
    AsyncDReadWriteLock,
]
SEMAPHORES: tuple[Any, ...] = (DSemaphore, AsyncDSemaphore)


def make(cls: Any, service: str, client: object, **options: Any) -> Any:
    if cls in SEMAPHORES:
        options.setdefault("max_permits", 3)
    return cls(service, client, **options)


# -- the cases found, and their neighbours --------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("service", "reaches"),
    [
        ("x:permit:0", "service 'x', key 'permit:0:k'"),
        ("x:fence", "service 'x', key 'permit:0:k' (x:fence's fence of it)"),
        ("y:rwlock", "service 'y', key 'rwlock:k'"),
        ("a:holders:b", "service 'a', key 'b:holders:k'"),
        ("a:b:waiters", "service 'a:b', key 'waiters:k'"),
        ("a::signal", "service 'a:', key 'signal:k'"),
    ],
)
def test_a_service_name_that_reaches_another_services_records_is_refused_before_any_call(
    cls: Any, service: str, reaches: str
) -> None:
    client = RecordingRedis()
    with pytest.raises(InvalidArgumentError, match="Redis key layout") as raised:
        make(cls, service, client)
    assert repr(service) in str(raised.value), "the message names the service"
    assert client.calls == [], f"a call reached the client ({reaches})"


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "prefix", ["x:permit:0:", "fence:", ":rwlock:", "a:signal:b:", "holders:x"]
)
def test_a_key_prefix_with_a_kind_word_before_its_last_colon_is_refused(
    cls: Any, prefix: str
) -> None:
    client = RecordingRedis()
    with pytest.raises(InvalidArgumentError, match="key_prefix"):
        make(cls, "svc", client, key_prefix=prefix)
    assert client.calls == []


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "options",
    [
        {"service_name": "permit"},  # the first part: after _dmutex_, never a kind word
        {"service_name": "fence:x"},
        {"service_name": "x:permits"},
        {"service_name": "x:permit0"},
        {"service_name": "x-signal:y"},
        {"service_name": "x:rwlock-y"},
        {"service_name": "a::b"},
        {"key_prefix": ""},
        {"key_prefix": "app:locks:"},
        {"key_prefix": "app:permit"},  # the last part: no ':' after it
        {"key_prefix": "app-fence"},
    ],
)
def test_names_next_to_the_refused_ones_are_accepted(cls: Any, options: dict[str, str]) -> None:
    client = RecordingRedis()
    service = options.pop("service_name", "svc")
    assert isinstance(make(cls, service, client, **options), cls)
    assert client.calls == []


@pytest.mark.parametrize("cls", [DMutex, DSemaphore, DReadWriteLock])
def test_the_rule_is_redis_layouts_only(cls: Any, tmp_path: Path) -> None:
    """A table or a dict per namespace keeps any service apart: those backends take the name."""
    sqlite = SQLiteBackend(tmp_path / "locks.sqlite3")
    try:
        for client in (InMemoryBackend(), sqlite):
            lock = make(cls, "x:permit:0", client)
            take = lock.acquire_write if cls is DReadWriteLock else lock.acquire
            handle = take("k")
            assert handle is not None
            assert handle.release() is True
    finally:
        sqlite.close()


@pytest.mark.parametrize(
    ("kind", "one", "two", "shared"),
    [
        ("mutex", ("x:permit:0", "k"), ("x", "permit:0:k"), "_dmutex_x:permit:0:permit:0:k"),
        ("mutex", ("x:fence", "k"), ("x", "permit:0:k"), "_dmutex_x:fence:permit:0:k"),
        ("readwrite", ("y:rwlock", "k"), ("y", "rwlock:k"), "_drwlock_y:rwlock:rwlock:k"),
    ],
)
def test_without_the_rule_the_cases_found_share_a_record(
    kind: Kind, one: tuple[str, str], two: tuple[str, str], shared: str
) -> None:
    """Why: stores made past the rule (directly) give two namespaces' records one name."""
    client = RecordingRedis()
    found = []
    for service, key in (one, two):
        prefix = f"{DEFAULT_PREFIX[kind]}{service}:"
        store: RedisStore | RedisReadWriteStore
        if kind == "readwrite":
            store = RedisReadWriteStore(client, prefix, None, SYSTEM_CLOCK)
        else:
            store = RedisStore(client, prefix, 1, SYSTEM_CLOCK)
        found.append(records(store, key))
    assert found[0][shared] != found[1][shared], "two records, one name"
    for service, _ in (one, two):
        refused = opened(Space(kind, service, None, 1)) is None
        assert refused == (service == one[0]), "the rule refuses the longer service only"
    assert client.calls == []


# -- no two namespaces share a record name ----------------------------------


@dataclass(frozen=True)
class Space:
    """A namespace as a face is given it: a kind, and a service or a key_prefix."""

    kind: Kind
    service: str | None
    key_prefix: str | None
    permits: int


Record = tuple[str, str, int | None, str]
"""A record as the layout reads it: (prefix, kind word, slot or None, key)."""


def space_options(space: Space) -> Options:
    return Options.check(
        space.kind,
        service_name=space.service if space.service is not None else "svc",
        max_permits=space.permits,
        default_ttl_seconds=300,
        db_name="dmutex",
        collection_prefix=DEFAULT_PREFIX[space.kind],
        table_prefix=DEFAULT_PREFIX[space.kind],
        key_prefix=space.key_prefix,
    )


def opened(space: Space) -> RedisStore | RedisReadWriteStore | None:
    """The store the faces open for ``space`` on a Redis client; None: refused."""
    client = RecordingRedis()
    try:
        options = space_options(space)
        if space.kind == "readwrite":
            store: object = open_readwrite_store(client, options, asynchronous=False)
        else:
            store = open_store(client, options, asynchronous=False)
    except InvalidArgumentError:
        return None
    assert client.calls == []
    assert isinstance(store, (RedisStore, RedisReadWriteStore))
    return store


def records(store: RedisStore | RedisReadWriteStore, key: str) -> dict[str, Record]:
    """Every record name the store uses for ``key``, each read back as the layout says."""
    prefix = store._prefix
    found: dict[str, tuple[str, int | None]] = {}
    if isinstance(store, RedisReadWriteStore):
        found[store._name(key)] = ("rwlock", None)
        wakes = store._wakes(key)
    else:
        groups = store._groups(key)
        for slot, name in enumerate(name for group in groups for name in group):
            found[name] = ("permit", slot)
        counter = store._counter(key, groups)
        assert counter is not None, "fencing=None keeps a counter on one server"
        found[counter] = ("fence", None)
        holders = store._holders(key, groups)
        if holders is not None:
            found[holders] = ("holders", None)
        wakes = store._wakes(key, groups)
    assert len(wakes) == 2, "a client that may block: its waiting records are named"
    found[wakes[0]] = ("waiters", None)
    found[wakes[1]] = ("signal", None)
    read: dict[str, Record] = {}
    for name, (word, number) in found.items():
        assert word in REDIS_KINDS
        middle = "" if number is None else f"{number}:"
        assert name == f"{prefix}{word}:{middle}{key}", "the layout, as documented"
        read[name] = (prefix, word, number, key)
    return read


# Pieces that make collisions likely: the kind words, slot numbers, the
# default prefixes, empty parts.
WORDS = ["x", "y", "", "0", "1", "2", "k", "_dmutex_", "_dsemaphore_", "_drwlock_", *REDIS_KINDS]
texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(":".join)
KINDS: list[Kind] = ["mutex", "semaphore", "readwrite"]


@st.composite
def spaces(draw: st.DrawFn) -> Space:
    kind = draw(st.sampled_from(KINDS))
    permits = draw(st.integers(2, 3)) if kind == "semaphore" else 1
    if draw(st.booleans()):
        service = draw(texts.filter(bool))
        return Space(kind, service, None, permits)
    # A key_prefix of the guarantee: empty or ending in ':' (as every default one does).
    prefix = draw(st.one_of(st.just(""), texts.map(lambda text: text + ":")))
    return Space(kind, None, prefix, permits)


def readings(name: str) -> list[tuple[str, str, int | None, str]]:
    """Every reading of ``name`` as prefix + kind + ":" + rest, the prefix empty or ending in :."""
    found = []
    for cut in [0, *(i + 1 for i, c in enumerate(name) if c == ":")]:
        prefix, rest = name[:cut], name[cut:]
        word, colon, tail = rest.partition(":")
        if not colon or word not in REDIS_KINDS:
            continue
        slot: int | None = None
        if word == "permit":
            number, colon, tail = tail.partition(":")
            if not (colon and number.isascii() and number.isdigit() and str(int(number)) == number):
                continue
            slot = int(number)
            if slot >= 3:
                continue
        try:
            check_key(tail)
        except InvalidArgumentError:
            continue
        found.append((prefix, word, slot, tail))
    return found


def spaces_of(prefix: str, word: str, slot: int | None, *, services: bool) -> list[Space]:
    """The namespaces that name a record ``prefix + word + ...``: by key_prefix, or by service.

    ``services``: by service only.
    """
    if word == "rwlock":
        kinds: list[Kind] = ["readwrite"]
    elif word in ("permit", "fence", "holders"):
        kinds = ["mutex", "semaphore"] if word != "holders" and not slot else ["semaphore"]
    else:
        kinds = list(KINDS)
    found = []
    for kind in kinds:
        permits = 1 if kind != "semaphore" else 3
        if not services:
            found.append(Space(kind, None, prefix, permits))
        default = DEFAULT_PREFIX[kind]
        if prefix.startswith(default) and prefix.endswith(":") and len(prefix) > len(default) + 1:
            found.append(Space(kind, prefix[len(default) : -1], None, permits))
    return found


def check_no_record_shared(
    space: Space, key: str, data: st.DataObject, *, services: bool = False
) -> None:
    """No other accepted namespace reads one of ``space``'s records of ``key`` as its own."""
    store = opened(space)
    assume(store is not None)
    assert store is not None
    try:
        check_key(key)
    except InvalidArgumentError:
        assume(False)
    mine = records(store, key)
    name = data.draw(st.sampled_from(sorted(mine)))
    for prefix, word, slot, other_key in readings(name):
        for other in spaces_of(prefix, word, slot, services=services):
            theirs = opened(other)
            if theirs is None:
                continue  # refused: it names no record at all
            named = records(theirs, other_key)
            assert name in named, "the reading is the layout's"
            assert named[name] == mine[name], (
                f"{name!r} is {space}'s record of {key!r} and {other}'s of {other_key!r}"
            )


@settings(max_examples=400, deadline=None)
@given(space=spaces(), key=texts, data=st.data())
def test_no_record_of_an_accepted_namespace_is_another_accepted_namespaces(
    space: Space, key: str, data: st.DataObject
) -> None:
    check_no_record_shared(space, key, data)


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    service=texts.filter(bool),
    key=texts,
    data=st.data(),
)
def test_no_record_of_an_accepted_service_is_another_accepted_services(
    kind: Kind, service: str, key: str, data: st.DataObject
) -> None:
    """The same, over service names alone (the default prefixes)."""
    space = Space(kind, service, None, 3 if kind == "semaphore" else 1)
    check_no_record_shared(space, key, data, services=True)
