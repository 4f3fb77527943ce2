"""Hostile values for every public parameter: only TypeError/ValueError, and never after a request.

Hypothesis draws a class (DMutex, DSemaphore, AsyncDMutex, AsyncDSemaphore), a
client (a recording Redis or MongoDB double of the class's face, the other
face's double, or an InMemoryBackend; see ``tests/_support/fault_clients.py``),
constructor arguments, and one to three operations with their arguments
(``acquire``, ``acquire_with_retry``, ``run``, ``run_with_retry``, ``extend``,
``ready``, ``lock``/``unlock``, ``release`` by token, and a handle's
``release``/``extend``). Each value is usually a valid one and sometimes a
hostile one: huge ints, Fractions, Decimals, NaN/inf/-0.0/subnormals/1e308,
bools, None, bytes, str subclasses, empty and very long strings, lone
surrogates, NUL, MongoDB-illegal names, ``max_permits`` above
``dmutex.MAX_PERMITS`` or negative. One parameter per example (the *focus*)
is hostile most of the time, the others rarely, so that most examples get as
far as the operations.

The property, for the constructor and for every operation: it returns, or
raises an instance of ``TypeError`` or ``ValueError`` (not ``UnicodeError``,
a ``ValueError`` that only the encoder raises) and then the double recorded
no request for it. ``get_database``/``get_collection`` are lookups without
I/O, as in pymongo, and do not count. Three values must raise even though a
free server would accept the request: ``max_permits`` above the bound, a
MongoDB namespace over 255 bytes, and a client of the other face. A ``run``
callback of the other face can only be found out by calling it, after the
acquire: there the property is a ``TypeError`` and no permit left held.

``test_issue_rows`` pins the rows of issue 10 (hole 5, 6 and 7) one by one.
"""

from __future__ import annotations

import asyncio
import math
import reprlib
import string
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any

import fakeredis
import mongomock
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dmutex
from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DSemaphore,
    InMemoryBackend,
    ManualClock,
    SystemClock,
)
from dmutex._clock import Clock
from dmutex._core.lease import now_ms
from tests._support.fault_clients import (
    Recorder,
    RecordingMongo,
    async_recording_redis,
    recording_redis,
)
from tests._support.mongo_clients import frozen_ttl_monitor


@pytest.fixture(autouse=True, scope="module")
def _mongomock_ttl_monitor_held_still() -> Iterator[None]:
    """mongomock's TTL imitation calls ``datetime.utcnow()``, deprecated since Python 3.12
    (an error under this suite's warning filter); the doubles answer as a free server, so
    holding it still changes nothing they answer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
        yield


MAX_PERMITS: int = getattr(dmutex, "MAX_PERMITS", 1024)
NAMESPACE_LIMIT = 255  # bytes of "db.collection" that MongoDB accepts
EXAMPLES = 250
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HANDLE_KEY = "handle-key"

CLASSES: dict[str, Any] = {
    "DMutex": DMutex,
    "DSemaphore": DSemaphore,
    "AsyncDMutex": AsyncDMutex,
    "AsyncDSemaphore": AsyncDSemaphore,
}
ASYNC = {"AsyncDMutex", "AsyncDSemaphore"}
SEMAPHORES = {"DSemaphore", "AsyncDSemaphore"}
# A client of the other face ends every example at the constructor: drawn less often.
CLIENT_KINDS = (
    "redis", "mongodb", "redis", "mongodb", "memory", "redis-other-face", "mongodb-other-face",
)  # fmt: skip


class _Omit:
    """Leave the argument out: the default applies."""

    def __repr__(self) -> str:
        return "OMIT"


class _Callback:
    """A ``run`` callback, resolved per class: of its face, or of the other face."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


OMIT = _Omit()
VALID_CALLBACK = _Callback("VALID_CALLBACK")
WRONG_FACE = _Callback("WRONG_FACE_CALLBACK")


class StrSub(str):
    """A str subclass: a str all the same."""

    __slots__ = ()


class IntSub(int):
    """An int subclass: an int all the same."""


class OnlyTime:
    """Half a clock: ``time`` and nothing else."""

    def time(self) -> float:
        return 0.0


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40
short = _REPR.repr
"""A repr that keeps a 400-digit int or a 300-character name to one line."""


# --- value strategies ---------------------------------------------------------------

SAFE = string.ascii_letters + string.digits + "_-"
safe_text = st.text(SAFE, min_size=1, max_size=24)
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Any code point, lone surrogates included (st.text leaves them out).
any_text = st.lists(st.one_of(st.characters(), surrogates), max_size=12).map("".join)
long_text = st.text(SAFE + "é", min_size=250, max_size=400)

HOSTILE_STRINGS: list[object] = [
    "", " ", "a.", "a..b", ".x", "x.", ".", "..", "$x", "a$b", "system.x", "system.",
    "a b", "a/b", "a\\b", '"', "nul\x00", "\x00", "\ud800", "a\udfffb", "\udc80",
    "x" * 300, "é" * 200, "*", "{tag}", "permit:0:k", "a\nb",
    StrSub("svc"), StrSub(""), b"svc", bytearray(b"x"), None, 5, True, ["svc"], object(),
]  # fmt: skip
HOSTILE_NUMBERS: list[object] = [
    0, -1, -0.0, 0.0, math.nan, -math.nan, math.inf, -math.inf,
    1e308, 1.7976931348623157e308, 1e300, 1e12, 1e16, 5e-324, 2.2250738585072014e-308,
    10**400, -(10**400), 2**1024, 2**63, Fraction(10**400, 3), Fraction(-1, 2),
    Fraction(1, 3), Fraction(10**400), Decimal("1"), Decimal("NaN"), Decimal("1e400"),
    Decimal("-0"), IntSub(5), True, False, None, "1", b"1", 1j, [1], object(),
]  # fmt: skip
HOSTILE_PERMITS: list[object] = [
    0, -1, MAX_PERMITS + 1, MAX_PERMITS * 2, 3_000_000, 10**400, -(10**400), 2**63,
    True, False, 2.0, math.nan, math.inf, Fraction(2), Fraction(5, 2), Decimal(2), "2",
    None, IntSub(3), b"\x02",
]  # fmt: skip
HOSTILE_BACKENDS: list[object] = [
    "Redis", "MONGODB", "", "mongo", "memory", "redis ", b"redis", StrSub("redis"),
    StrSub("mongodb"), 5, True, "\ud800", "redis", "mongodb",
]  # fmt: skip
HOSTILE_CALLBACKS: list[object] = [None, 5, "callback", b"cb", WRONG_FACE]

hostile_strings = st.one_of(st.sampled_from(HOSTILE_STRINGS), any_text, long_text)
hostile_numbers = st.one_of(
    st.sampled_from(HOSTILE_NUMBERS),
    st.floats(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.fractions(),
    st.decimals(),
)
valid_seconds = st.one_of(st.integers(1, 10**6), st.floats(0.001, 1e8))
valid_timeout = st.one_of(st.just(OMIT), st.just(0), st.floats(0, 2), st.integers(0, 5))
valid_delay = st.one_of(st.just(OMIT), st.floats(0.001, 1), st.just(5e-324))


@dataclass(frozen=True)
class Param:
    """One public parameter: what a valid value and a hostile one look like."""

    valid: st.SearchStrategy[object]
    hostile: st.SearchStrategy[object]


CONSTRUCTOR: dict[str, Param] = {
    "service_name": Param(safe_text, hostile_strings),
    "max_permits": Param(
        st.one_of(st.integers(1, 5), st.just(MAX_PERMITS)),
        st.one_of(st.sampled_from(HOSTILE_PERMITS), st.integers(-(10**500), 10**500)),
    ),
    "default_ttl_seconds": Param(st.one_of(st.just(OMIT), valid_seconds), hostile_numbers),
    "backend": Param(st.just(OMIT), st.sampled_from(HOSTILE_BACKENDS)),  # valid: per client
    "db_name": Param(st.one_of(st.just(OMIT), st.just("dmutex"), safe_text), hostile_strings),
    "collection_name": Param(st.one_of(st.just(OMIT), st.none(), safe_text), hostile_strings),
    "collection_prefix": Param(st.one_of(st.just(OMIT), st.just(""), safe_text), hostile_strings),
    "key_prefix": Param(
        st.one_of(st.just(OMIT), st.none(), st.just(""), st.text(max_size=20)),
        hostile_strings,
    ),
    "clock": Param(
        st.just(OMIT),  # valid: per client
        st.sampled_from(
            [object(), "clock", 5, OnlyTime(), ManualClock, SystemClock, ManualClock()]
        ),
    ),
}
OPERATION: dict[str, Param] = {
    "key": Param(
        st.one_of(safe_text, st.text(min_size=1, max_size=40)),
        st.one_of(hostile_strings, st.sampled_from(["k" * 1000, StrSub("k")])),
    ),
    "ttl": Param(st.one_of(st.just(OMIT), st.none(), valid_seconds), hostile_numbers),
    "timeout": Param(valid_timeout, hostile_numbers),
    "retry_delay": Param(valid_delay, hostile_numbers),
    "token": Param(st.one_of(st.uuids().map(str), safe_text), hostile_strings),
    "callback": Param(st.just(VALID_CALLBACK), st.sampled_from(HOSTILE_CALLBACKS)),
}
FOCUSES = ("none", *CONSTRUCTOR, *OPERATION)

# Each operation: the parameters it takes, in call order. Keyword-only ones
# are passed by name, the rest positionally.
METHODS: dict[str, tuple[str, ...]] = {
    "acquire": ("key", "ttl"),
    "acquire_with_retry": ("key", "ttl", "timeout", "retry_delay"),
    "run": ("key", "callback", "ttl"),
    "run_with_retry": ("key", "callback", "ttl", "timeout", "retry_delay"),
    "extend": ("key", "token", "ttl"),
    "ready": (),
    "handle.release": (),
    "handle.extend": ("ttl",),
}
MUTEX_METHODS: dict[str, tuple[str, ...]] = {"lock": ("key", "ttl"), "unlock": ("key", "token")}
SEMAPHORE_METHODS: dict[str, tuple[str, ...]] = {"release": ("key", "token")}
POSITIONAL = {"key", "token", "callback"}
KEYWORD_ONLY = {"timeout", "retry_delay"}


def methods_of(cls_name: str) -> dict[str, tuple[str, ...]]:
    extra = SEMAPHORE_METHODS if cls_name in SEMAPHORES else MUTEX_METHODS
    return {**METHODS, **extra}


# --- a client and its storage -------------------------------------------------------


@dataclass
class World:
    """One example's client, what reached it, and its storage."""

    kind: str
    client: object
    recorder: Recorder
    reset: Callable[[object], None]
    """Make the server free again (an InMemoryBackend: the given key's permits)."""
    active: Callable[[float], int]
    """How many permits storage holds that are active at a time (epoch seconds)."""
    closers: list[Callable[[], object]] = field(default_factory=list)

    @property
    def backend(self) -> str:
        return self.kind.removesuffix("-other-face")

    def valid_backend(self) -> st.SearchStrategy[object]:
        names: list[object] = [OMIT, None]
        if self.backend != "memory":
            names.append(self.backend)
        return st.sampled_from(names)

    def valid_clock(self) -> st.SearchStrategy[object]:
        if isinstance(self.client, InMemoryBackend):
            return st.sampled_from([OMIT, None, self.client.clock])
        return st.one_of(
            st.sampled_from([OMIT, None]),
            st.builds(ManualClock),
            st.builds(SystemClock),
        )

    async def close(self) -> None:
        for closer in self.closers:
            result = closer()
            if isinstance(result, Awaitable):
                await result


def flush(inspector: fakeredis.FakeRedis) -> None:
    """Empty the fake server, through a client that records nothing."""
    inspector.flushall()


def make_world(kind: str, asynchronous: bool) -> World:
    """A recording client of ``kind`` for a class of this face (the other: *-other-face)."""
    recorder = Recorder()
    face_async = asynchronous != kind.endswith("-other-face")
    if kind.startswith("redis"):
        server = fakeredis.FakeServer()
        inspector = fakeredis.FakeRedis(server=server, decode_responses=True)
        client: fakeredis.FakeRedis | fakeredis.FakeAsyncRedis
        if face_async:
            client = async_recording_redis(recorder, server)
            closer: Callable[[], object] = client.aclose
        else:
            client = recording_redis(recorder, server)
            closer = client.close
        return World(
            kind,
            client,
            recorder,
            reset=lambda key: flush(inspector),
            active=lambda now: len(inspector.keys("*permit:*")),
            closers=[closer, inspector.close],
        )
    if kind.startswith("mongodb"):
        mongo = RecordingMongo(recorder, asynchronous=face_async)
        return World(
            kind,
            mongo.client,
            recorder,
            reset=lambda key: mongo.reset(),
            active=mongo.active,
            closers=[mongo.close],
        )
    backend = InMemoryBackend(clock=ManualClock())

    def forget(key: object) -> None:
        if isinstance(key, str):
            backend.force_expire(key)
        backend.force_expire(HANDLE_KEY)

    return World(kind, backend, recorder, reset=forget, active=lambda now: len(backend.snapshot()))


# --- drawing ------------------------------------------------------------------------


def draw_value(
    data: st.DataObject, name: str, param: Param, focus: str, valid: st.SearchStrategy[object]
) -> object:
    """A valid value mostly; a hostile one 70% of the time for the focus, 3% otherwise."""
    odds = 70 if name == focus else 3
    hostile = data.draw(st.integers(0, 99), label=f"{name} die") < odds
    return data.draw(param.hostile if hostile else valid, label=name)


def draw_constructor(
    data: st.DataObject, cls_name: str, world: World, focus: str
) -> dict[str, object]:
    options: dict[str, object] = {}
    for name, param in CONSTRUCTOR.items():
        if name == "max_permits" and cls_name not in SEMAPHORES:
            continue
        valid = param.valid
        if name == "backend":
            valid = world.valid_backend()
        elif name == "clock":
            valid = world.valid_clock()
        options[name] = draw_value(data, name, param, focus, valid)
    return options


@dataclass
class Call:
    """One operation to try, with its arguments as drawn."""

    method: str
    args: dict[str, object]

    def split(self) -> tuple[list[object], dict[str, object]]:
        """Positional and keyword arguments, leaving out OMIT."""
        positional = [v for n, v in self.args.items() if n in POSITIONAL and v is not OMIT]
        keywords = {n: v for n, v in self.args.items() if n not in POSITIONAL and v is not OMIT}
        return positional, keywords


def draw_call(data: st.DataObject, cls_name: str, focus: str) -> Call:
    methods = methods_of(cls_name)
    names = sorted(m for m, params in methods.items() if focus not in OPERATION or focus in params)
    method = data.draw(st.sampled_from(names), label="method")
    args: dict[str, object] = {}
    for name in methods[method]:
        param = OPERATION[name]
        valid = param.valid
        if method == "unlock" and name == "token":
            valid = st.one_of(st.just(OMIT), st.none(), valid)
        args[name] = draw_value(data, name, param, focus, valid)
    return Call(method, args)


# --- judging ------------------------------------------------------------------------


def acceptable(error: BaseException) -> bool:
    """A TypeError or ValueError, but not an encoder's UnicodeError."""
    return isinstance(error, (TypeError, ValueError)) and not isinstance(error, UnicodeError)


def judge(what: str, error: Exception | None, world: World, sent_before: int) -> None:
    """The property: success, or an acceptable error with no request recorded for ``what``."""
    if error is None:
        return
    sent = world.recorder.requests[sent_before:]
    assert acceptable(error), f"{what} raised {type(error).__module__}.{short(error)}"
    assert not sent, f"{what} raised {short(error)} after {len(sent)} request(s): {short(sent)}"


def namespace_too_long(options: dict[str, object], cls_name: str) -> bool:
    """Whether the options name a MongoDB namespace over the limit (False if it cannot be told)."""
    db = options.get("db_name", OMIT)
    parts = ["dmutex" if db is OMIT else db, "."]
    collection = options.get("collection_name", OMIT)
    if collection is OMIT or collection is None:
        prefix = options.get("collection_prefix", OMIT)
        default = "_dsemaphore_" if cls_name in SEMAPHORES else "_dmutex_"
        parts += [default if prefix is OMIT else prefix, options["service_name"]]
    else:
        parts.append(collection)
    if not all(isinstance(part, str) for part in parts):
        return False
    try:
        return len("".join(str(part) for part in parts).encode()) > NAMESPACE_LIMIT
    except UnicodeError:
        return False  # not a name at all: the encoder refuses it on the first request


def judge_constructed(cls_name: str, options: dict[str, object], world: World) -> None:
    """What must not be accepted, although a free server would take the request."""
    permits = options.get("max_permits")
    if isinstance(permits, int) and not isinstance(permits, bool):
        assert permits <= MAX_PERMITS, f"accepted max_permits={short(permits)} > {MAX_PERMITS}"
    if world.kind == "mongodb":
        assert not namespace_too_long(options, cls_name), (
            f"accepted a MongoDB namespace over {NAMESPACE_LIMIT} bytes: {short(options)}"
        )
    assert not world.kind.endswith("other-face"), (
        f"{cls_name} accepted a client of the other face ({type(world.client).__name__})"
    )


# --- running ------------------------------------------------------------------------


def sync_callback(handle: object) -> str:
    return "done"


async def async_callback(handle: object) -> str:
    return "done"


def callback_for(value: object, asynchronous: bool) -> object:
    if value is VALID_CALLBACK:
        return async_callback if asynchronous else sync_callback
    if value is WRONG_FACE:
        return sync_callback if asynchronous else async_callback
    return value


async def settle(result: object) -> object:
    return await result if isinstance(result, Awaitable) else result


@dataclass
class Example:
    """One drawn example, run on either face (``settle`` awaits the async face's calls)."""

    cls_name: str
    world: World
    options: dict[str, object]
    calls: list[Call]
    outcomes: list[tuple[str, Exception | None]] = field(default_factory=list)
    """What was tried (the constructor, then each call) and what it raised."""

    @property
    def asynchronous(self) -> bool:
        return self.cls_name in ASYNC

    async def run(self) -> None:
        world = self.world
        kwargs = {name: value for name, value in self.options.items() if value is not OMIT}
        service = kwargs.pop("service_name")
        what = f"{self.cls_name}({short(service)}, <{world.kind}>, **{short(kwargs)})"
        sent = len(world.recorder.requests)
        error: Exception | None = None
        instance: Any = None
        try:
            instance = CLASSES[self.cls_name](service, world.client, **kwargs)
        except Exception as exc:  # noqa: BLE001 - judged below
            error = exc
        self.outcomes.append((what, error))
        judge(what, error, world, sent)
        if error is not None:
            return
        judge_constructed(self.cls_name, self.options, world)
        for call in self.calls:
            await self.attempt(instance, call)

    async def attempt(self, instance: Any, call: Call) -> None:
        world = self.world
        world.reset(call.args.get("key"))
        target: Any = instance
        name = call.method
        if name.startswith("handle."):
            # The handle's acquire is an operation like any other; only a
            # handle it returned can be tried.
            target = await self.judged(f"acquire({HANDLE_KEY!r})", instance.acquire, [HANDLE_KEY])
            if target is None:
                return
            name = name.removeprefix("handle.")
        positional, keywords = call.split()
        wrong_face = call.args.get("callback") is WRONG_FACE
        if "callback" in call.args:
            positional[1] = callback_for(call.args["callback"], self.asynchronous)
        what = f"{call.method}(*{short(positional)}, **{short(keywords)})"
        if not wrong_face:
            await self.judged(what, getattr(target, name), positional, keywords)
            return
        # A callback of the other face is found out only by calling it, after
        # the acquire: a TypeError (or an earlier argument's error), and no
        # permit left behind.
        # MongoDB leases run by the instance's clock (Redis and InMemoryBackend by their own).
        clock = self.options.get("clock")
        reader = clock if isinstance(clock, ManualClock) else SystemClock()
        # Permits of earlier calls in this example (a handle still held) stay.
        held_before = world.active(store_time(reader))
        error = (await self.outcome(what, getattr(target, name), positional, keywords))[1]
        assert error is not None, f"{what}: a callback of the other face was accepted"
        assert acceptable(error), f"{what} raised {type(error).__module__}.{short(error)}"
        assert world.active(store_time(reader)) <= held_before, f"{what} left a permit held"

    async def outcome(
        self,
        what: str,
        method: Callable[..., object],
        positional: list[object],
        keywords: dict[str, object] | None = None,
    ) -> tuple[object, Exception | None]:
        """Call (and await) ``method``; its result or what it raised, noted in :attr:`outcomes`."""
        result: object = None
        error: Exception | None = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                result = await settle(method(*positional, **(keywords or {})))
        except Exception as exc:  # noqa: BLE001 - judged by the caller
            error = exc
        self.outcomes.append((what, error))
        return result, error

    async def judged(
        self,
        what: str,
        method: Callable[..., object],
        positional: list[object],
        keywords: dict[str, object] | None = None,
    ) -> object:
        """:meth:`outcome`, judged by the property; the result, None if it raised."""
        sent = len(self.world.recorder.requests)
        result, error = await self.outcome(what, method, positional, keywords)
        judge(what, error, self.world, sent)
        return result


def store_time(clock: Clock) -> float:
    """``clock``'s time as the stores read it: in whole milliseconds (``now_ms``).

    A lease of 1 ms that the store already counts as expired (its release
    then deletes nothing) is otherwise still active for up to half a
    millisecond of the exact time.
    """
    return now_ms(clock) / 1000


def run_example(data: st.DataObject, cls_name: str) -> None:
    asynchronous = cls_name in ASYNC
    focus = data.draw(st.sampled_from(FOCUSES), label="focus")
    if focus == "max_permits" and cls_name not in SEMAPHORES:
        focus = "none"
    kind = data.draw(st.sampled_from(CLIENT_KINDS), label="client")

    async def main() -> None:
        world = make_world(kind, asynchronous)
        try:
            options = draw_constructor(data, cls_name, world, focus)
            count = data.draw(st.integers(1, 3), label="operations")
            calls = [draw_call(data, cls_name, focus) for _ in range(count)]
            await Example(cls_name, world, options, calls).run()
        finally:
            await world.close()

    asyncio.run(main())


@pytest.mark.parametrize("cls_name", list(CLASSES))
@SETTINGS
@given(data=st.data())
def test_every_parameter(cls_name: str, data: st.DataObject) -> None:
    """Every parameter of the constructor and the methods: only TypeError/ValueError, before I/O."""
    run_example(data, cls_name)


# --- the issue's rows, one by one ---------------------------------------------------

_OK: dict[str, object] = {
    "key": "k",
    "callback": VALID_CALLBACK,
    "token": "0f2c52bb-4b34-4f3e-8a4d-1b1f0b8e8c11",
}


def row(method: str, **args: object) -> Call:
    """A call of ``method`` with valid arguments except those given."""
    params = {**METHODS, **MUTEX_METHODS, **SEMAPHORE_METHODS}[method]
    assert set(args) <= set(params), f"{method} takes no {set(args) - set(params)}"
    return Call(method, {name: args.get(name, _OK.get(name, OMIT)) for name in params})


ROWS: list[tuple[str, str, str, dict[str, object], Call | None]] = [
    # (id, class, client kind, constructor options, operation or None)
    ("max_permits=MAX+1", "DSemaphore", "redis", {"max_permits": MAX_PERMITS + 1}, None),
    ("max_permits=10**400", "DSemaphore", "memory", {"max_permits": 10**400}, None),
    ("max_permits=3e6 async", "AsyncDSemaphore", "redis", {"max_permits": 3_000_000}, None),
    ("default_ttl=10**400", "DMutex", "redis", {"default_ttl_seconds": 10**400}, None),
    ("default_ttl=Fraction", "AsyncDMutex", "memory",
     {"default_ttl_seconds": Fraction(10**400, 7)}, None),
    ("ttl=10**400", "DMutex", "redis", {}, row("acquire", ttl=10**400)),
    ("ttl=Fraction", "DSemaphore", "mongodb", {"max_permits": 2},
     row("acquire", ttl=Fraction(10**400, 3))),
    ("timeout=10**400", "DMutex", "redis", {},
     row("acquire_with_retry", timeout=10**400)),
    ("timeout=Fraction", "AsyncDMutex", "redis", {},
     row("acquire_with_retry", timeout=Fraction(10**400, 3))),
    ("retry_delay=10**400", "DSemaphore", "memory", {"max_permits": 2},
     row("run_with_retry", retry_delay=10**400)),
    ("retry_delay=Fraction", "AsyncDSemaphore", "redis", {"max_permits": 2},
     row("acquire_with_retry", retry_delay=Fraction(10**400, 3))),
    ("handle.extend ttl=10**400", "AsyncDMutex", "mongodb", {},
     row("handle.extend", ttl=10**400)),
    ("service_name=a.", "DMutex", "mongodb", {"service_name": "a."}, None),
    ("service_name=a..b", "AsyncDSemaphore", "mongodb",
     {"service_name": "a..b", "max_permits": 2}, None),
    ("collection_name=.x", "DMutex", "mongodb", {"collection_name": ".x"}, None),
    ("service_name=300 chars", "DMutex", "mongodb", {"service_name": "s" * 300}, None),
    ("db_name=lone surrogate", "DMutex", "mongodb", {"db_name": "\ud800"}, None),
    ("service_name=lone surrogate", "DMutex", "redis", {"service_name": "\ud800"},
     row("acquire", key="k")),
    ("key=lone surrogate redis", "DMutex", "redis", {}, row("acquire", key="\ud800")),
    ("key=lone surrogate mongodb", "AsyncDSemaphore", "mongodb", {"max_permits": 2},
     row("acquire", key="\ud800")),
    ("token=lone surrogate", "DSemaphore", "redis", {"max_permits": 2},
     row("release", key="k", token="\ud800")),
    ("sync redis to AsyncDMutex", "AsyncDMutex", "redis-other-face", {},
     row("acquire", key="k")),
    ("sync mongodb to AsyncDSemaphore", "AsyncDSemaphore", "mongodb-other-face",
     {"max_permits": 2}, row("acquire", key="k")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cls_name", "kind", "options", "call"),
    [pytest.param(*row[1:], id=row[0]) for row in ROWS],
)
def test_issue_rows(
    cls_name: str, kind: str, options: dict[str, object], call: Call | None
) -> None:
    """Each row of issue 10's holes 5-7 raises TypeError/ValueError with no request sent."""
    options = {name: OMIT for name in CONSTRUCTOR} | {"service_name": "svc", **options}
    if cls_name not in SEMAPHORES:
        del options["max_permits"]

    async def main() -> list[tuple[str, Exception | None]]:
        world = make_world(kind, cls_name in ASYNC)
        example = Example(cls_name, world, options, [] if call is None else [call])
        try:
            await example.run()
        finally:
            await world.close()
        return example.outcomes

    outcomes = asyncio.run(main())
    # The row is bad input: the constructor or the operation raised (and
    # judge() saw that it was a TypeError/ValueError, with no request sent).
    what, error = outcomes[-1]
    assert error is not None, f"{what} was accepted"
