"""The budget of blocking waits: how many waiters may hold a pool's connections at once.

Used by the stores whose waiters block on a connection of their own: Redis
(``BLPOP``, ``redis/waits.py``) and PostgreSQL (``LISTEN``,
``postgres/listening.py``).

Rules of this module:

1. A blocking wait never takes a connection that a holder's release needs:
   on a pool, at most half its size at once (:class:`Blockers`), shared by
   every store on that pool (:func:`pool_budget`).
2. A waiter that keeps failing marks itself again every :data:`REFRESH`
   seconds, so that its mark (a Redis registration, a PostgreSQL
   ``waiters:`` row) outlives no wait by more than that.
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["REFRESH", "Blockers", "pool_budget"]

# Seconds after which a waiter's failed attempt marks it again: well inside
# the mark's margin past its longest wait.
REFRESH = 1.0


class Blockers:
    """How many blocking waits may hold connections of one pool at once.

    Half the pool's size, so that waiters never take the connections that a
    holder's release, or any other work, needs.
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


def pool_budget(pool: object, limit: int) -> Blockers:
    """The :class:`Blockers` of ``pool``, made with ``limit`` by its first store (rule 1).

    A pool that takes no weak reference gets a budget per call (per store).
    """
    with _POOLS_LOCK:
        try:
            return _POOLS.setdefault(pool, Blockers(limit))
        except TypeError:
            return Blockers(limit)
