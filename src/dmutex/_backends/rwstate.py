"""A read-write lock's state as the SQL stores keep it: one JSON text per key.

Rules of this module:

1. The text is compact JSON, no whitespace, ASCII only, its fields in this
   order: ``{"dmutex":"rwlock","w":W,"r":R,"i":I}``, with ``,"f":F`` last
   where the fence counter lives in the state (PostgreSQL, MySQL; SQLite
   keeps it in the mutex's ``fence:{k}`` row). ``W`` is the writer
   ``["<token>",<expiry ms>]`` or ``null``, ``R`` the readers
   ``{"<token>":<expiry ms>,...}``, ``I`` the waiting writers' intents
   ``{"<token>":<until ms>,...}``, each sorted by token; ``F`` the last
   fence granted (0: none).
2. A text is read as dmutex's only if it is exactly that: the mark, the
   layout's fields and nothing else, each of its type. Anything else (another
   program's value, a later format, which would carry another mark or
   field) reads as None, and the stores refuse to change it.
3. Encoding is canonical: one state has one text, so a store can compare
   texts to tell whether a decision changed anything, and compare-and-set
   on the text it read.
"""

from __future__ import annotations

import json
from typing import cast

from .._core.readwrite import State

__all__ = ["decode", "encode"]

MARK = "rwlock"
_FIELDS = frozenset({"dmutex", "w", "r", "i"})
_FENCED_FIELDS = _FIELDS | {"f"}


def _is_time(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _times(value: object) -> dict[str, int] | None:
    """A JSON object of token -> time as the layout writes it; None if it is not one."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(token, str) and _is_time(at) for token, at in value.items()):
        return None
    return cast("dict[str, int]", value)


def decode(value: object, *, fenced: bool = False) -> State | None:
    """The state ``value`` holds; None if dmutex did not write it (rule 2).

    ``fenced``: the layout that carries the fence counter (``"f"``).
    """
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str):
        return None
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        return None
    fields = _FENCED_FIELDS if fenced else _FIELDS
    if not isinstance(data, dict) or data.keys() != fields or data["dmutex"] != MARK:
        return None
    writer, readers, intents = data["w"], _times(data["r"]), _times(data["i"])
    fence = data.get("f", 0)
    if readers is None or intents is None or not _is_time(fence):
        return None
    if writer is None:
        return State(None, readers, intents, fence)
    if not (
        isinstance(writer, list)
        and len(writer) == 2
        and isinstance(writer[0], str)
        and _is_time(writer[1])
    ):
        return None
    return State((writer[0], writer[1]), readers, intents, fence)


def encode(state: State, *, fenced: bool = False) -> str:
    """The text of ``state``, byte for byte as rule 1 says."""
    data: dict[str, object] = {
        "dmutex": MARK,
        "w": None if state.writer is None else list(state.writer),
        "r": dict(sorted(state.readers.items())),
        "i": dict(sorted(state.intents.items())),
    }
    if fenced:
        data["f"] = state.fence
    return json.dumps(data, separators=(",", ":"))
