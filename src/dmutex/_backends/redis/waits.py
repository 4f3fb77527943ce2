"""The budget of blocking waits: how many waiters may block (``BLPOP``) on one pool.

It sits in ``dmutex._backends.redis`` beside the store (``store.py``), whose
``wait`` asks it before it blocks.

Rules of this module:

1. A blocking wait never takes a connection that a holder's release needs:
   never on a client with one dedicated connection, and on a pool at most
   half its ``max_connections`` at once (:class:`Blockers`), shared by
   every store on that pool.
2. A block ends before the socket gives up: at most 0.8 of the pool's
   ``socket_timeout``.
"""

from __future__ import annotations

import sys
import threading
import weakref

__all__ = ["MIN_BLOCK", "REFRESH", "TICK", "Blockers", "block_budget"]

# A wait shorter than this sleeps: BLPOP counts its timeout in milliseconds,
# and a timeout that rounds to 0 would block forever.
MIN_BLOCK = 0.002
# Seconds after which a waiter's failed attempt registers it again: well
# inside the registration's margin past its longest wait (REGISTRATION_MARGIN_MS).
REFRESH = 1.0
# A server ends a blocked command whose timeout passed on its next timer
# tick, every 1/hz seconds (hz 10 by default; 6.2, 7.0 and 7.4 alike): a
# BLPOP of 0.15 s returns after 0.2 s. A longer wait blocks this much less
# than it lasts, so that it still ends on time.
TICK = 0.1


class Blockers:
    """How many blocking waits may hold connections of one pool at once.

    Half the pool's ``max_connections``, so that waiters never take the
    connections that a holder's release, or any other work, needs.
    """

    __slots__ = ("__weakref__", "_count", "_limit", "_lock")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Claim a connection for one blocking wait; False when the budget is spent."""
        with self._lock:
            if self._count >= self._limit:
                return False
            self._count += 1
            return True

    def give(self) -> None:
        """Return what :meth:`take` claimed."""
        with self._lock:
            self._count -= 1


_POOLS: weakref.WeakKeyDictionary[object, Blockers] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def block_budget(client: object) -> tuple[Blockers, float] | None:
    """The budget and the longest single block for waits through ``client``; None: never block.

    Never on a client with one dedicated connection (redis-py's
    ``single_connection_client``): a blocked wait would hold the very
    connection that the holder's release needs. On a pool, half its
    ``max_connections`` (none below 2); a block lasts at most 0.8 of the
    pool's ``socket_timeout``, so that it ends before the socket gives up.
    """
    # redis.asyncio makes the one connection at the first command: the flag says it first.
    if getattr(client, "connection", None) is not None or (
        getattr(client, "single_connection_client", False) is True
    ):
        return None
    pool = getattr(client, "connection_pool", None)
    limit = getattr(pool, "max_connections", None)
    budget = limit // 2 if isinstance(limit, int) and not isinstance(limit, bool) else sys.maxsize
    if budget < 1:
        return None
    kwargs = getattr(pool, "connection_kwargs", None)
    timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    cap = 0.8 * timeout if isinstance(timeout, (int, float)) and timeout > 0 else float("inf")
    if pool is None:
        return Blockers(budget), cap
    with _POOLS_LOCK:
        try:
            blockers = _POOLS.get(pool)
            if blockers is None:
                blockers = _POOLS[pool] = Blockers(budget)
        except TypeError:  # a pool that takes no weak reference: a budget per store
            blockers = Blockers(budget)
    return blockers, cap
