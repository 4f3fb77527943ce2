"""The Redis backend, one file per thing it holds.

- ``scripts.py``: the Lua scripts, one named constant each;
- ``waits.py``: the budget of blocking waits (``BLPOP`` wake-ups) per pool;
- ``store.py``: :class:`RedisStore`, which runs the scripts and the waits;
- ``readwrite.py``: :class:`RedisReadWriteStore`, read-write locks, one hash each.
"""

from __future__ import annotations

from .descriptor import BACKEND
from .readwrite import RedisReadWriteStore
from .store import RedisStore

__all__ = ["BACKEND", "RedisReadWriteStore", "RedisStore"]
