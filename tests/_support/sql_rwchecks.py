"""The checks the PostgreSQL and MySQL read-write stores share: one JSON row per key.

``tests/integration/test_postgres_readwrite.py`` and ``test_mysql_readwrite.py``
run them on their servers through an :class:`Env` of their own; what
differs (the column types, the forever value, how a row is written behind
the store's back) stays in each file.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from dmutex import DMutexError
from tests._support.faces import Handle
from tests._support.rwfaces import RWFace, Side
from tests._support.rwrows import fence_of, granted, ms_of, text

KEY = "orders"
ROW = f"rwlock:{KEY}"
TTL = 30.0
STRANGER = "6f1c1a9e-3d0b-4c55-9b1e-1f2a3b4c5d6e"
FOREIGN = [
    STRANGER,  # a token, as a lock of another program
    "{not json",
    '{"dmutex":"rwlock","w":null,"r":{},"i":{}}',  # no fence counter: SQLite's layout
    '{"dmutex":"mutex","w":null,"r":{},"i":{},"f":0}',  # another mark
    '{"dmutex":"rwlock","w":null,"r":{},"i":{},"f":0,"v":2}',  # a field not known
    '{"dmutex":"rwlock","w":null,"r":{"t":1.5},"i":{},"f":0}',  # an expiry not an integer
]
"""Values of the row ``rwlock:{KEY}`` that dmutex did not write."""


class Env(Protocol):
    """A server's test rig: locks of one face on one service, and a look at its table."""

    def make(self, **options: Any) -> RWFace: ...

    def stored(self) -> tuple[str, Any] | None:
        """The row ``rwlock:{KEY}``: its value and its ``expired_at`` as the file reads it."""
        ...

    def value(self) -> str: ...

    def keys(self) -> list[str]: ...

    def now_us(self) -> int: ...

    def expire(self, token: str) -> None: ...


def check_fences(env: Env) -> None:
    """Every grant's fence above the one before, a writer's above every earlier one, in the row."""
    lock, other = env.make(), env.make()
    lock, other = env.make(), env.make()
    before = env.now_us()
    r1, r2 = granted(lock.acquire("read", KEY, TTL)), granted(other.acquire("read", KEY, TTL))
    after = env.now_us()
    assert before <= fence_of(r1) <= after, "the first fence is the server's clock in µs"
    assert r1.release()
    assert r2.release()
    w1 = granted(lock.acquire("write", KEY, TTL))
    assert w1.release()
    r3 = granted(other.acquire("read", KEY, TTL))
    assert lock.acquire("write", KEY, TTL) is None
    r4 = granted(lock.acquire("read", KEY, TTL))
    assert r3.release()
    assert r4.release()
    w2 = granted(other.acquire("write", KEY, TTL))
    seen = [fence_of(h) for h in (r1, r2, w1, r3, r4, w2)]
    assert seen == sorted(set(seen)), f"not strictly rising: {seen}"
    assert fence_of(w1) > max(fence_of(r1), fence_of(r2))
    assert fence_of(w2) > max(fence_of(r3), fence_of(r4))
    assert json.loads(env.value())["f"] == fence_of(w2), "the row keeps the last fence"
    assert lock.holders(KEY).fence == fence_of(w2)
    assert w2.release()
    assert json.loads(env.value())["f"] == fence_of(w2), "a release leaves the counter"
    assert fence_of(granted(lock.acquire("read", KEY, TTL))) > fence_of(w2)


def check_fencing_off(env: Env) -> None:
    """``fencing=False``: no fence on a hold nor in ``holders``."""
    lock = env.make(fencing=False)
    reader = granted(lock.acquire("read", KEY, TTL))
    assert reader.fence is None
    assert lock.holders(KEY).fence is None
    assert reader.release() is True
    writer = granted(lock.acquire("write", KEY, TTL))
    assert writer.fence is None
    assert lock.holders(KEY).fence is None
    assert writer.release() is True


def check_row(env: Env, forever: object) -> None:
    """The row's text byte for byte through reads, an intent, releases, a writer, an expiry."""
    lock, other = env.make(), env.make()
    a = granted(lock.acquire("read", KEY, 30.0))
    b = granted(other.acquire("read", KEY, 45.5))
    readers = {a.token: ms_of(a.expired_at), b.token: ms_of(b.expired_at)}
    assert fence_of(b) > fence_of(a)
    assert env.stored() == (text(None, readers, {}, fence_of(b)), forever)
    assert env.keys() == [ROW], "one row per key, the fence counter inside it"

    _, token, _ = other.intend(KEY, TTL, retry_delay=0.5)
    until = json.loads(env.value())["i"][token]
    assert env.stored() == (text(None, readers, {token: until}, fence_of(b)), forever)
    assert other.release_token(KEY, token) is False
    assert a.release() is True
    assert env.stored() == (text(None, {b.token: readers[b.token]}, {}, fence_of(b)), forever)
    assert b.release() is True
    assert env.stored() == (text(None, {}, {}, fence_of(b)), forever), "the row stays"

    writer = granted(lock.acquire("write", KEY, 12.345))
    expires = ms_of(writer.expired_at)
    assert env.stored() == (text((writer.token, expires), {}, {}, fence_of(writer)), forever)
    assert writer.release() is True
    assert env.stored() == (text(None, {}, {}, fence_of(writer)), forever)

    # A writer whose hold ran out: the next change drops it, its fence kept below.
    late = granted(lock.acquire("write", KEY, TTL))
    env.expire(late.token)
    reader = granted(other.acquire("read", KEY, TTL))
    assert fence_of(reader) > fence_of(late)
    assert env.stored() == (
        text(None, {reader.token: ms_of(reader.expired_at)}, {}, fence_of(reader)),
        forever,
    )
    assert late.release() is False
    assert reader.release() is True
    assert env.stored() == (text(None, {}, {}, fence_of(reader)), forever)
    assert env.keys() == [ROW]


def check_foreign(env: Env) -> None:
    """A row dmutex did not write (already in place): every operation raises, nothing changes."""
    lock = env.make()
    stored = env.stored()
    calls: list[Callable[[], object]] = [
        lambda: lock.acquire("read", KEY, TTL),
        lambda: lock.acquire("write", KEY, TTL),
        lambda: lock.acquire_with_retry("write", KEY, ttl=TTL, timeout=0.05, retry_delay=0.01),
        lambda: lock.release_token(KEY, STRANGER),
        lambda: lock.extend(KEY, STRANGER, TTL),
        lambda: lock.holders(KEY),
    ]
    message = re.escape(f"the row '{ROW}' of table ") + r".*did not write"
    for call in calls:
        with pytest.raises(DMutexError, match=message):
            call()
        assert env.stored() == stored
    assert granted(lock.acquire("read", "another key", TTL)).release() is True


def check_statements(
    lock: RWFace, taken: Callable[[], list[str]], write: str, stamped: str
) -> None:
    """Statements per operation, by their first word as ``taken()`` lists them since its last call.

    On a key the store has not seen, a grant is the read, then the write (its
    first word ``write``); once it has (``rwcas.py``, rule 8), a grant, an
    extend or a release that ends a hold is the stamped write alone (its
    first word ``stamped``); a refusal, ``holders``, a release of nothing: the
    read alone.
    """
    taken()
    first = granted(lock.acquire("read", KEY, TTL))
    assert taken() == ["SELECT", write], "a first grant: the read, then the write"
    second = granted(lock.acquire("read", KEY, TTL))
    assert taken() == [stamped], "a grant on a key the store knows: the write alone"
    assert lock.acquire("write", KEY, TTL) is None
    assert taken() == ["SELECT"], "a refused writer (no intent: one attempt)"
    assert [h.token for h in lock.holders(KEY).holders] == sorted([first.token, second.token])
    assert taken() == ["SELECT"], "holders: the read alone"
    assert first.extend(TTL) is True
    assert taken() == [stamped]
    assert first.release() is True
    assert taken() == [stamped]
    assert first.release() is False
    assert taken() == ["SELECT"], "nothing to release: nothing written"
    assert second.release() is True
    assert taken() == [stamped]
    writer = granted(lock.acquire("write", KEY, TTL))
    assert taken() == [stamped]
    assert lock.acquire("read", KEY, TTL) is None
    assert taken() == ["SELECT"], "a refused reader: the read alone"
    assert writer.release() is True
    assert taken() == [stamped]
    assert lock.release_token("never held", STRANGER) is False
    assert taken() == ["SELECT"], "no row: nothing written"
    assert lock.holders("never held").holders == []
    assert taken() == ["SELECT"]


LONG_DELAY = 10.0
"""The waiting tests' ``retry_delay``: nothing but a wake explains a grant within :data:`WOKEN`."""
WOKEN = 2.5
"""A woken waiter's grant comes within this many seconds of the release (a generous bound)."""


def store_of(rw: RWFace) -> Any:
    """The lock's store (both sides share it)."""
    return rw.target._reading._store._store  # type: ignore[attr-defined]


@dataclass
class Watch:
    """What a store's ``wait`` saw: when the first began, how each ended, an early release."""

    waiting: threading.Event = field(default_factory=threading.Event)
    woken: list[bool] = field(default_factory=list)
    released: list[tuple[float, bool]] = field(default_factory=list)


def watch(store: Any, early: Handle | None = None) -> Watch:
    """Wrap ``store.wait``; ``early`` is released as the first wait begins, before it listens."""
    seen = Watch()
    wait = store.wait

    def watched(key: str, waiter: Any, seconds: float) -> Any:
        if early is not None and not seen.waiting.is_set():
            seen.released.append((time.monotonic(), early.release()))
        seen.waiting.set()
        yield from wait(key, waiter, seconds)
        seen.woken.append(bool(waiter.woken))

    store.wait = watched
    return seen


def waited(
    rw: RWFace,
    seen: Watch,
    side: Side,
    hold: Handle | None,
    *,
    timeout: float = 30.0,
    settle: float = 0.0,
) -> tuple[Handle, float]:
    """``rw``'s retrying acquire in a thread: what it got, and how long after the release.

    ``hold``: released here once the first wait began, and ``settle`` seconds
    more (PostgreSQL: time to listen); None: released by that wait as it
    began (``watch(early=...)``). The acquire's ``retry_delay`` is
    :data:`LONG_DELAY`: a waiter nothing wakes waits at least half of it.
    """
    result: list[tuple[Handle | None, float]] = []

    def take() -> None:
        got = rw.acquire_with_retry(side, KEY, ttl=TTL, timeout=timeout, retry_delay=LONG_DELAY)
        result.append((got, time.monotonic()))

    thread = threading.Thread(target=take)
    thread.start()
    try:
        assert seen.waiting.wait(10.0), "the first attempt was not refused"
        if hold is not None:
            time.sleep(settle)
            seen.released.append((time.monotonic(), hold.release()))
    finally:
        thread.join(30.0)
    assert not thread.is_alive()
    ((released, done),) = seen.released
    assert done is True, "the hold in the way was released"
    got, at = result[0]
    return granted(got), at - released
