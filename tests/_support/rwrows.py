"""Read-write lock rows as the SQL stores keep them (JSON state), changed by hand in tests."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from dmutex import AsyncDReadLock, DReadLock
from dmutex._core.lease import EPOCH
from tests._support.faces import Handle


def hold_expired(value: str, token: str, now: int) -> str:
    """A read-write row's JSON ``value``, ``token``'s hold expiring by ``now`` (ms)."""
    state = json.loads(value)
    if state["w"] is not None and state["w"][0] == token:
        state["w"][1] = min(state["w"][1], now)
    if token in state["r"]:
        state["r"][token] = min(state["r"][token], now)
    return json.dumps(state, separators=(",", ":"))


def text(
    writer: tuple[str, int] | None,
    readers: dict[str, int],
    intents: dict[str, int],
    fence: int,
) -> str:
    """A PostgreSQL or MySQL row's value as ``rwstate.py`` documents it, written out by hand."""
    w = "null" if writer is None else f'["{writer[0]}",{writer[1]}]'
    r = ",".join(f'"{t}":{e}' for t, e in sorted(readers.items()))
    i = ",".join(f'"{t}":{e}' for t, e in sorted(intents.items()))
    return f'{{"dmutex":"rwlock","w":{w},"r":{{{r}}},"i":{{{i}}},"f":{fence}}}'


def granted(handle: Handle | None) -> Handle:
    """``handle``, which must have been granted."""
    assert handle is not None, "expected the hold to be granted"
    return handle


def fence_of(handle: Handle) -> int:
    """The fence of a hold of a lock that fences (read-write locks do by default)."""
    assert handle.fence is not None, "read-write locks fence by default"
    return handle.fence


def is_read(handle: Handle) -> bool:
    """Whether ``handle`` is a reader's hold (of either face)."""
    return isinstance(handle.raw, (DReadLock, AsyncDReadLock))


def ms_of(moment: datetime) -> int:
    """``moment`` in epoch milliseconds, as the stores keep expiries."""
    return (moment - EPOCH) // timedelta(milliseconds=1)
