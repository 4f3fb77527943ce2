"""``dmutex status``: the active permits of a key, as a table or as JSON.

Guarantee: changes no lease. Exit status 0 if any permit of the key is
held, 1 if none is. Each permit shows its slot, expiry (UTC), time left and
a shortened token, never the whole token (whoever has the token can
release the lock); the key's fence counter (the latest grant's fence) is
shown where the backend keeps one. With ``--read-write``, the key's
read-write lock: its writer or each reader, a role ("write", "read") in
place of the slot. The JSON document names its ``kind`` ("mutex",
"semaphore", "readwrite"); a read-write lock's has ``limit`` null and a
``role`` per holder instead of a ``slot``.

Caveats: what it shows was true when it was read. A SQLite file that does
not exist (in a directory that does, or the default file) is reported free
and is not created; reading an existing one, or a PostgreSQL or MySQL
database, creates the lock table if it is missing, as any operation does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TextIO

from .._errors import ArgumentTypeError, InvalidArgumentError, UnsupportedClientError
from .args import StatusArgs
from .errors import FREE, OK, USAGE, Failure, backend_errors, one_line
from .holders import Holder, Inspection, read_holders, role_of
from .progress import short_token, token_prefix
from .urls import connect, parse

__all__ = ["render_json", "render_text", "status"]

STATUS_TIMEOUT = 5.0  # seconds a request may take: status is interactive


def _iso(ms: int) -> str:
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _holder_json(args: StatusArgs, h: Holder, now_ms: int) -> dict[str, object]:
    place: dict[str, object] = {"role": role_of(h)} if args.readwrite else {"slot": h.slot}
    return {
        **place,
        "token_prefix": token_prefix(h.token),
        "expires_at": _iso(h.expires_ms),
        "expires_ms": h.expires_ms,
        "left_seconds": round(max(0, h.expires_ms - now_ms) / 1000, 3),
    }


def render_json(args: StatusArgs, found: Inspection) -> str:
    """One JSON object: key, service, kind, limit, held, now, fence, and each holder."""
    holders = [_holder_json(args, h, found.now_ms) for h in found.holders]
    document = {
        "key": args.key,
        "service": args.service,
        "kind": args.kind,
        "limit": None if args.readwrite else args.limit,  # a read-write lock has no permits
        "held": bool(found.holders),
        "now": _iso(found.now_ms),
        "fence": found.fence,
        "holders": holders,
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
        lines.append(f"  {column:<6}{'expires (UTC)':<26}{'left':>10}  token")
        for h in found.holders:
            left = f"{max(0, h.expires_ms - found.now_ms) / 1000:.1f} s"
            token = short_token(h.token)
            place = role_of(h) if args.readwrite else str(h.slot)
            lines.append(f"  {place:<6}{_iso(h.expires_ms):<26}{left:>10}  {token}")
    if found.fence is not None:
        lines.append(f"fence: {found.fence} (the latest grant's)")
    return "\n".join(lines)


def status(args: StatusArgs, env: Mapping[str, str], stdout: TextIO) -> int:
    """Print the key's permits on ``stdout``; 0 if held, 1 if free, or raise :class:`Failure`."""
    target = parse(args.backend, env)
    path = target.path
    if path is not None and not path.exists() and (target.default or path.parent.is_dir()):
        found = Inspection(holders=[], fence=None, now_ms=_now_ms())  # no file: nothing held
    else:
        backend = connect(target, timeout=STATUS_TIMEOUT)
        try:
            with backend_errors(backend):
                found = read_holders(
                    backend.client,
                    service=args.service,
                    limit=args.limit,
                    key=args.key,
                    db_name=backend.db_name,
                    schema_name=target.schema,
                    readwrite=args.readwrite,
                )
        except UnsupportedClientError as error:  # a backend that serves no read-write lock
            option = "--read-write: " if args.readwrite else ""
            raise Failure(USAGE, f"{option}{one_line(error)}") from None
        except (InvalidArgumentError, ArgumentTypeError) as error:
            raise Failure(USAGE, one_line(error)) from None
        finally:
            backend.close()
    stdout.write((render_json(args, found) if args.json else render_text(args, found)) + "\n")
    stdout.flush()
    return OK if found.holders else FREE


def _now_ms() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1000)
