"""The budget of blocking waits: how many waiters may block (``BLPOP``) on one pool.

It sits in ``dmutex._backends.redis`` beside the store (``store.py``), whose
``wait`` asks it before it blocks.

Rules of this module:

1. A blocking wait never takes a connection that a holder's release needs:
   never on a client with one dedicated connection, and on a pool at most
   half its ``max_connections`` at once (``..blocking``'s rule 1).
2. A block ends before the socket gives up: at most 0.8 of the pool's
   ``socket_timeout``.
"""

from __future__ import annotations

import sys

from ..blocking import Blockers, pool_budget

__all__ = ["MIN_BLOCK", "TICK", "block_budget"]

# A wait shorter than this sleeps: BLPOP counts its timeout in milliseconds,
# and a timeout that rounds to 0 would block forever.
MIN_BLOCK = 0.002
# A server ends a blocked command whose timeout passed on its next timer
# tick, every 1/hz seconds (hz 10 by default; 6.2, 7.0 and 7.4 alike): a
# BLPOP of 0.15 s returns after 0.2 s. A longer wait blocks this much less
# than it lasts, so that it still ends on time.
TICK = 0.1


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
    return (Blockers(budget) if pool is None else pool_budget(pool, budget)), cap
