"""Who holds a lease: the holder's identity and start time, carried in its token.

A token is the one value every storage layout keeps for a lease, and the
TypeScript library reads it as an opaque string: it compares it, and never
parses it. So the holder's stamp rides in the token, after the random part,
and no layout gains a field.

Rules of this module:

1. A stamped token is ``f"{uuid4}|{since_ms}|{identity}"``: the random UUID4
   string that makes it unguessable, the epoch milliseconds when the acquire
   that took it began, and the identity, percent-encoded so that it holds
   only printable ASCII and no ``|``, ``%`` or brace (a Redis Cluster hash
   tag) of its own. Only the UUID is secret: whoever reads a stamp learns
   nothing that releases the lease.
2. A token is at most :data:`MAX_TOKEN_LENGTH` characters, MySQL's
   ``value varchar(128)`` in the TypeScript layout: the encoded identity is
   cut to fit (never inside an escape), and a cut identity ends in ``...``.
3. An empty identity stamps nothing: the token is the bare UUID4 string, as
   the TypeScript library's tokens are.
4. Reading is lenient: a token that is not a stamped one (the TypeScript
   library's, an earlier dmutex's, a caller's own) has no identity and no
   start time, never an error.
5. A retrying acquire keeps one token for all its attempts (engine rule 6),
   so its ``since`` is when the first attempt was made; a grant comes at or
   after it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import quote, unquote

MAX_TOKEN_LENGTH = 128
"""The longest token dmutex writes: MySQL's ``value varchar(128)``."""

_UUID_LENGTH = 36
_SINCE_DIGITS = 13  # epoch milliseconds until the year 2286
_ROOM = MAX_TOKEN_LENGTH - _UUID_LENGTH - _SINCE_DIGITS - 2
# Printable ASCII kept as it is, but for the separator, the escape sign and
# the braces of a Redis Cluster hash tag.
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in "|%{}")
_CUT = "..."


TOKEN_SHOWN = 8  # characters of a token shown: enough to tell holders apart, never the whole


def token_prefix(token: str) -> str:
    """The first characters of a token: 8, or half of a short one; never the whole token."""
    return token[: min(TOKEN_SHOWN, len(token) // 2)]


def default_identity() -> str:
    """``host:pid`` of this process: who a lease's holder is unless told otherwise."""
    return f"{socket.gethostname()}:{os.getpid()}"


def encode_identity(identity: str) -> str:
    """``identity`` as a token carries it (rule 1), cut to fit (rule 2)."""
    encoded = quote(identity, safe=_SAFE)
    if len(encoded) <= _ROOM:
        return encoded
    end = _ROOM - len(_CUT)
    # Never cut inside "%XX": back off to the escape's start.
    escape = encoded.rfind("%", end - 2, end)
    if escape != -1:
        end = escape
    return encoded[:end] + _CUT


@dataclass(frozen=True, slots=True)
class Stamp:
    """What a token says of its holder: identity and start (epoch ms), or None for each."""

    identity: str | None
    since_ms: int | None


NO_STAMP = Stamp(None, None)


class Stamper:
    """Mints the suffix of one instance's tokens (rule 1); the identity is fixed at creation.

    ``identity`` None: :func:`default_identity`, read again in a forked child
    (whose process id differs); ``""``: no stamp (rule 3).
    """

    __slots__ = ("_encoded", "_fixed", "_pid")

    def __init__(self, identity: str | None) -> None:
        self._fixed = identity is not None
        self._pid = os.getpid()
        self._encoded = encode_identity(default_identity() if identity is None else identity)

    def suffix(self, now_ms: int) -> str:
        """``|since|identity`` for a token minted at ``now_ms``; ``""`` when there is no stamp."""
        if not self._fixed and os.getpid() != self._pid:
            self._pid = os.getpid()
            self._encoded = encode_identity(default_identity())
        if not self._encoded:
            return ""
        return f"|{now_ms}|{self._encoded}"


def read_stamp(token: str) -> Stamp:
    """The stamp of ``token``, or :data:`NO_STAMP` where it carries none (rule 4)."""
    if len(token) <= _UUID_LENGTH + 1 or token[_UUID_LENGTH] != "|":
        return NO_STAMP
    since, bar, encoded = token[_UUID_LENGTH + 1 :].partition("|")
    if not bar or not since.isascii() or not since.isdigit() or len(since) > _SINCE_DIGITS:
        return NO_STAMP
    return Stamp(unquote(encoded), int(since))
