"""Client shapes: the checks dmutex makes of what any client object is.

One contract each, for every backend alike (each backend's own shape, the
names that tell its clients, is its package's ``shapes.py``):

- :func:`defines`: does the object's *type* define the name (a static lookup,
  so a ``__getattr__`` that answers any name, like pymongo's, cannot fool it);
- :func:`method`: the bound method to call, or :class:`UnsupportedClientError`;
- :func:`described`: a client's type, as errors name it;
- :func:`refuse_asyncio`: an asyncio object given to a sync class, refused
  before any call;
- :func:`refuse_sync`: a sync object of a package known to do its I/O before
  it returns, given to an asyncio class, refused before any call;
- :func:`refuse_other_face`: the one of the two an opener asks for;
- :func:`wrong_face`: the error for a call that answered in the other face's
  way (a driver's check, on the first request).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import UnsupportedClientError


def described(target: object) -> str:
    return f"{type(target).__module__}.{type(target).__qualname__}"


def defines(target: object, name: str) -> bool:
    """Whether ``target``'s type (or the object itself) defines ``name`` as non-None."""
    try:
        return inspect.getattr_static(target, name) is not None
    except AttributeError:
        return False


def method(target: object, name: str) -> Callable[..., object]:
    """``target.name`` if it is callable; else :class:`UnsupportedClientError`."""
    found: object = getattr(target, name, None)
    if not callable(found):
        raise UnsupportedClientError(f"{described(target)} has no {name}() that dmutex can call")
    return found


def refuse_asyncio(target: object, name: str, what: str) -> None:
    """Refuse an asyncio ``target`` (a client or a collection) for a sync class.

    Known before any call when ``target.name`` is a coroutine function
    (redis.asyncio, pymongo's async API, psycopg's and asyncpg's) or
    ``target`` is a motor object (every one has ``get_io_loop``; motor starts
    its request before it returns a Future, so this must be caught here).
    The other direction cannot be told from the object: a sync-looking
    method may return an awaitable, so the async driver checks the first
    reply (:func:`wrong_face`).
    """
    if inspect.iscoroutinefunction(getattr(target, name, None)) or defines(target, "get_io_loop"):
        raise UnsupportedClientError(
            f"{described(target)} is an asyncio {what}: use AsyncDMutex / AsyncDSemaphore"
        )


# Modules of a client package that hold its asyncio API (redis.asyncio,
# pymongo.asynchronous, ...): their plain functions are not sync I/O.
_ASYNC_MODULES = ("asyncio", "asynchronous")


def refuse_sync(
    target: object, name: str, what: str, packages: Sequence[str], counterparts: str
) -> None:
    """Refuse a sync ``target`` (a client or a collection) for an asyncio class.

    Known before any call when ``target.name`` is a plain function of one of
    ``packages`` (the backends' client packages that do their I/O before
    they return: redis-py, pymongo, psycopg, SQLAlchemy, ...) outside their
    asyncio modules: such a call sends its request before it returns, so the
    reply check would come too late. ``counterparts`` names the asyncio
    clients the error suggests. Other clients are judged by their first
    reply (:func:`wrong_face`).
    """
    fn = getattr(type(target), name, None)
    # motor wraps pymongo's sync methods (their __module__ is pymongo's) into
    # ones that return Futures; every motor object has get_io_loop.
    if fn is None or inspect.iscoroutinefunction(fn) or defines(target, "get_io_loop"):
        return
    parts = str(getattr(fn, "__module__", "") or "").split(".")
    if parts[0] in packages and not set(parts) & set(_ASYNC_MODULES):
        raise UnsupportedClientError(
            f"{described(target)} is a sync {what}: use DMutex / DSemaphore, or pass "
            f"its asyncio counterpart ({counterparts})"
        )


@dataclass(frozen=True, slots=True)
class Packages:
    """A backend's client packages: those whose I/O is done as they return, and asyncio ones."""

    sync: tuple[str, ...]
    asyncio: tuple[str, ...]


def refuse_other_face(
    target: object, name: str, what: str, packages: Packages, *, asynchronous: bool
) -> None:
    """Refuse ``target`` if its ``name`` shows the other face than ``asynchronous``'s."""
    if asynchronous:
        refuse_sync(target, name, what, packages.sync, ", ".join(packages.asyncio))
    else:
        refuse_asyncio(target, name, what)


def wrong_face(fn: object, result: object, *, callback: bool = False) -> UnsupportedClientError:
    """The error for a call that answered the other face's way.

    An awaitable reached a sync class, or a plain value an asyncio class;
    ``callback`` says the call was the user's ``run()`` callback, not the client.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    awaitable = inspect.isawaitable(result)
    if callback and awaitable:
        said = (
            f"callback {name} returned an awaitable; a sync class cannot await it "
            "(use the Async class for async callbacks)"
        )
    elif callback:
        said = (
            f"callback {name} returned {type(result).__name__}, not an awaitable; "
            "the Async classes need an async callback"
        )
    elif awaitable:
        said = (
            f"{name} returned an awaitable: this is an asyncio client, "
            "use AsyncDMutex / AsyncDSemaphore"
        )
    else:
        said = f"{name} did not return an awaitable: this is a sync client, use DMutex / DSemaphore"
    return UnsupportedClientError(said)
