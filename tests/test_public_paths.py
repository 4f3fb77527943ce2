"""The public names live at the public path: ``dmutex.X``, not the private module that defines X.

Reprs, ``help()``, docs and pickles show ``__module__``; a pickle names the
class by it, so an error pickled by one process unpickles in another through
``dmutex`` alone.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from collections.abc import Callable
from typing import cast

import pytest

import dmutex
from dmutex import DMutex, DSemaphore, InMemoryBackend, ManualClock

PUBLIC = [
    name
    for name in dmutex.__all__
    if inspect.isclass(getattr(dmutex, name)) or inspect.isfunction(getattr(dmutex, name))
]


def test_every_public_class_is_found_in_the_catalogue() -> None:
    # The loop below checks something only if the filter finds the classes.
    assert {"DMutex", "AsyncDSemaphore", "LeaseLostError", "RedisCommandClient"} <= set(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_a_public_class_reports_the_package_as_its_module(name: str) -> None:
    value = getattr(dmutex, name)
    assert value.__module__ == "dmutex"
    assert getattr(importlib.import_module(value.__module__), value.__qualname__) is value


def test_dmutex_reports_dmutex() -> None:
    assert DMutex.__module__ == "dmutex"
    assert repr(DMutex) == "<class 'dmutex.DMutex'>"


def _lease_lost() -> None:
    clock = ManualClock()
    handle = DMutex("svc", InMemoryBackend(clock=clock)).acquire("k", ttl=1)
    assert handle is not None
    clock.advance(2)
    handle.raise_if_lost()


def _no_client() -> None:
    DMutex("svc", cast("dmutex.SyncClient", object()))


def _service_not_a_string() -> None:
    DMutex(cast("str", 1), InMemoryBackend())


def _no_permits() -> None:
    DSemaphore("svc", InMemoryBackend(), max_permits=0)


@pytest.mark.parametrize(
    ("expected", "make"),
    [
        (dmutex.LeaseLostError, _lease_lost),
        (dmutex.UnsupportedClientError, _no_client),
        (dmutex.ArgumentTypeError, _service_not_a_string),
        (dmutex.InvalidArgumentError, _no_permits),
    ],
)
def test_an_error_dmutex_raises_pickles_and_unpickles_to_its_type(
    expected: type[dmutex.DMutexError], make: Callable[[], None]
) -> None:
    with pytest.raises(dmutex.DMutexError) as caught:
        make()
    error = caught.value
    assert type(error) is expected
    pickled = pickle.dumps(error)
    assert b"dmutex._" not in pickled  # named by the public path
    copy = pickle.loads(pickled)
    assert type(copy) is expected
    assert str(copy) == str(error)
