"""``dmutex status``: the active permits of a key, or a service's held keys, as text or JSON.

Guarantee: changes no lease. Exit status 0 if any permit of the key is
held, 1 if none is. Each permit shows its slot, expiry (UTC), time left, a
shortened token, never the whole token (whoever has the token can release
the lock), and its holder as the token's stamp says (``identity`` and
``since`` in JSON; ``dmutex._core.stamps``): "unknown" for a holder that
stamped none, such as the TypeScript library; the key's fence counter (the latest grant's fence) is
shown where the backend keeps one. With ``--read-write``, the key's
read-write lock: its writer or each reader, a role ("write", "read") in
place of the slot. The JSON document names its ``kind`` ("mutex",
"semaphore", "readwrite"); a read-write lock's has ``limit`` null and a
``role`` per holder instead of a ``slot``.

Without a key, the service's namespace of that kind (``holders.py``, rule
3): a line per held key (its holders, the time left of the lease that ends
first, its fence) and, when the store listed more than ``--max-keys``, a
line that says more exist; as JSON, one document whose ``keys`` are the
single-key documents of the held keys, with ``truncated``. Exit status 0 if
any key is held, 1 if none is.

``--watch SECONDS``: the same reads again every SECONDS through the same
connection, until interrupted: on a terminal each read replaces the last
(the screen is cleared), elsewhere each follows the last after a blank
line; with ``--json``, one document a line. Ctrl-C (SIGINT) ends it with
status 0; a read that fails ends it with that failure's status.

Caveats: what it shows was true when it was read; a namespace's keys are
listed, then read one by one, so each key's holders are those of its own
read. A SQLite file that does not exist (in a directory that does, or the
default file) is reported free and is not created; reading an existing
one, or a PostgreSQL or MySQL database, creates the lock table if it is
missing, as any operation does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TextIO

from .._core.stamps import Stamp, read_stamp, token_prefix
from .._errors import ArgumentTypeError, InvalidArgumentError, UnsupportedClientError
from .args import StatusArgs
from .errors import FREE, OK, USAGE, Failure, backend_errors, one_line
from .holders import Holder, Inspection, Namespace, Reader, role_of
from .progress import short_token
from .urls import Address, Connection, connect, parse

__all__ = ["render_json", "render_namespace_json", "render_namespace_text", "render_text", "status"]

STATUS_TIMEOUT = 5.0  # seconds a request may take: status is interactive
KEY_WIDTH = 40  # the key column of a namespace's table: wider keys push their line right
_CLEAR = "\x1b[H\x1b[2J"  # --watch on a terminal: cursor home, screen cleared


def _iso(ms: int) -> str:
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _holder_json(args: StatusArgs, h: Holder, now_ms: int) -> dict[str, object]:
    place: dict[str, object] = {"role": role_of(h)} if args.readwrite else {"slot": h.slot}
    stamp = read_stamp(h.token)
    since = None if stamp.since_ms is None else _iso(stamp.since_ms)
    return {
        **place,
        "identity": stamp.identity,
        "since": since,
        "token_prefix": token_prefix(h.token),
        "expires_at": _iso(h.expires_ms),
        "expires_ms": h.expires_ms,
        "left_seconds": round(max(0, h.expires_ms - now_ms) / 1000, 3),
    }


def _document(args: StatusArgs, key: str, found: Inspection) -> dict[str, object]:
    """A key's document: key, service, kind, limit, held, now, fence, and each holder."""
    return {
        "key": key,
        "service": args.service,
        "kind": args.kind,
        "limit": None if args.readwrite else args.limit,  # a read-write lock has no permits
        "held": bool(found.holders),
        "now": _iso(found.now_ms),
        "fence": found.fence,
        "holders": [_holder_json(args, h, found.now_ms) for h in found.holders],
    }


def render_json(args: StatusArgs, found: Inspection) -> str:
    """One JSON object: key, service, kind, limit, held, now, fence, and each holder."""
    assert args.key is not None  # a key's status
    return json.dumps(_document(args, args.key, found))


def render_namespace_json(args: StatusArgs, found: Namespace) -> str:
    """One JSON object: service, kind, limit, held, now, max_keys, truncated, and each key's.

    ``keys`` holds a document per held key, as :func:`render_json` writes
    a key's; ``truncated``: the store listed more than ``max_keys`` keys.
    """
    document = {
        "service": args.service,
        "kind": args.kind,
        "limit": None if args.readwrite else args.limit,
        "held": bool(found.found),
        "now": _iso(found.now_ms),
        "max_keys": args.max_keys,
        "truncated": found.truncated,
        "keys": [_document(args, key, seen) for key, seen in found.found],
    }
    return json.dumps(document)


def _heading(args: StatusArgs, found: Inspection) -> str:
    if args.readwrite:
        kind = "read-write lock"
        count = len(found.holders)
        if not found.holders:
            state = "free"
        elif role_of(found.holders[0]) == "write":
            state = "held by the writer"
        else:
            state = f"held by {count} reader{'s' if count > 1 else ''}"
    else:
        kind = "mutex" if args.limit == 1 else f"semaphore of {args.limit}"
        state = f"held ({len(found.holders)} of {args.limit})" if found.holders else "free"
    return f"{args.key!r} (service {args.service!r}, {kind}): {state}"


def render_text(args: StatusArgs, found: Inspection) -> str:
    """A heading line, a table of the active permits (or holds), and the fence counter."""
    lines = [_heading(args, found)]
    if found.holders:
        column = "role" if args.readwrite else "slot"
        lines.append(f"  {column:<6}{'expires (UTC)':<26}{'left':>10}  {'token':<13}  holder")
        for h in found.holders:
            left = f"{max(0, h.expires_ms - found.now_ms) / 1000:.1f} s"
            token = short_token(h.token)
            place = role_of(h) if args.readwrite else str(h.slot)
            who = _holder_text(read_stamp(h.token), found.now_ms)
            lines.append(f"  {place:<6}{_iso(h.expires_ms):<26}{left:>10}  {token:<13}  {who}")
    if found.fence is not None:
        lines.append(f"fence: {found.fence} (the latest grant's)")
    return "\n".join(lines)


def _holder_text(stamp: Stamp, now_ms: int) -> str:
    """``host:4242, for 12.5 s``; ``unknown`` for a token without a stamp (TypeScript's)."""
    if stamp.identity is None or stamp.since_ms is None:
        return "unknown"
    held = max(0, now_ms - stamp.since_ms) / 1000
    return f"{_shown_identity(stamp.identity)}, for {held:.1f} s"


def _shown_identity(identity: str) -> str:
    """An identity as a line shows it: as it is, or quoted if it has unprintable text."""
    return identity if identity.isprintable() else repr(identity)


def _shown_key(key: str) -> str:
    """A key as a table shows it: as it is, or quoted if it has spaces or unprintable text."""
    plain = key.isprintable() and not any(c.isspace() for c in key)
    return key if plain else repr(key)


def _holding(args: StatusArgs, found: Inspection) -> str:
    """Who holds a key, in a few words: ``2 of 4``, ``writer``, ``3 readers``."""
    count = len(found.holders)
    if not args.readwrite:
        return f"{count} of {args.limit}"
    if role_of(found.holders[0]) == "write":
        return "writer"
    return f"{count} reader{'s' if count > 1 else ''}"


def render_namespace_text(args: StatusArgs, found: Namespace) -> str:
    """A heading line, a line per held key, and a line saying if more exist.

    Each key's line: its holders, the time left of its lease that ends
    first, and its fence counter (``-``: none kept).
    """
    if args.readwrite:
        kinds = "read-write locks"
    else:
        kinds = "mutexes" if args.limit == 1 else f"semaphores of {args.limit}"
    count = len(found.found)
    state = "no key held" if count == 0 else f"{count} key{'s' if count > 1 else ''} held"
    lines = [f"service {args.service!r} ({kinds}): {state}"]
    if found.found:
        rows = [("key", "holders", "left", "fence")]
        for key, seen in found.found:
            first = min(h.expires_ms for h in seen.holders)
            left = f"{max(0, first - seen.now_ms) / 1000:.1f} s"
            fence = "-" if seen.fence is None else str(seen.fence)
            rows.append((_shown_key(key), _holding(args, seen), left, fence))
        width = min(KEY_WIDTH, max(len(row[0]) for row in rows))
        held = max(len(row[1]) for row in rows)
        left_width = max(len(row[2]) for row in rows)
        for shown, holding, left, fence in rows:
            lines.append(f"  {shown:<{width}}  {holding:<{held}}  {left:>{left_width}}  {fence}")
    if found.truncated:
        lines.append(f"{count} keys shown; more exist (--max-keys {args.max_keys})")
    return "\n".join(lines)


class _Session:
    """The reads of one ``dmutex status``: the backend opened at the first, kept for the next."""

    def __init__(self, args: StatusArgs, address: Address) -> None:
        self._args = args
        self._address = address
        self._backend: Connection | None = None
        self._reader: Reader | None = None

    def _absent(self) -> bool:
        """Whether the backend's file is missing where the command reports it free, uncreated."""
        path = self._address.path
        return (
            path is not None
            and not path.exists()
            and (self._address.default or path.parent.is_dir())
        )

    def read(self) -> Inspection | Namespace:
        """The key's holders, or the namespace's held keys; raises :class:`Failure`."""
        args = self._args
        if self._absent():  # no file: nothing held
            if args.key is None:
                return Namespace(found=[], truncated=False, now_ms=_now_ms())
            return Inspection(holders=[], fence=None, now_ms=_now_ms())
        if self._backend is None:
            self._backend = connect(self._address, timeout=STATUS_TIMEOUT)
        backend = self._backend
        try:
            with backend_errors(backend):
                if self._reader is None:
                    self._reader = Reader(
                        backend.client,
                        service=args.service,
                        limit=args.limit,
                        **backend.options,
                        readwrite=args.readwrite,
                    )
                if args.key is None:
                    return self._reader.namespace(args.max_keys)
                return self._reader.holders(args.key)
        except UnsupportedClientError as error:  # a backend that serves no read-write lock
            option = "--read-write: " if args.readwrite else ""
            raise Failure(USAGE, f"{option}{one_line(error)}") from None
        except (InvalidArgumentError, ArgumentTypeError) as error:
            raise Failure(USAGE, one_line(error)) from None

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()


def _render(args: StatusArgs, found: Inspection | Namespace) -> str:
    if isinstance(found, Namespace):
        if args.json:
            return render_namespace_json(args, found)
        return render_namespace_text(args, found)
    return render_json(args, found) if args.json else render_text(args, found)


def _held(found: Inspection | Namespace) -> bool:
    return bool(found.found if isinstance(found, Namespace) else found.holders)


def status(args: StatusArgs, env: Mapping[str, str], stdout: TextIO) -> int:
    """Print the key's permits (or the namespace's held keys) on ``stdout``.

    0 if held, 1 if free, or raise :class:`Failure`; with ``--watch``, read
    again until interrupted, then 0.
    """
    session = _Session(args, parse(args.backend, env))
    try:
        return _show(args, session, stdout)
    except KeyboardInterrupt:
        if args.watch is None:
            raise
        return OK  # --watch ends with Ctrl-C
    finally:
        session.close()


def _show(args: StatusArgs, session: _Session, stdout: TextIO) -> int:
    watching = args.watch is not None and not args.json
    clear = watching and _isatty(stdout)
    reads = 0
    while True:
        found = session.read()
        text = _render(args, found)
        if watching:
            heading = f"every {args.watch:g} s until interrupted; read at {_iso(_now_ms())}"
            text = f"{_CLEAR if clear else ''}{heading}\n{text}"
            if reads and not clear:
                text = "\n" + text
        stdout.write(text + "\n")
        stdout.flush()
        if args.watch is None:
            return OK if _held(found) else FREE
        reads += 1
        time.sleep(args.watch)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: not a terminal
        return False


def _now_ms() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1000)
