"""``dmutex status``: the active permits of a key, as a table or as JSON.

Guarantee: changes no lease. Exit status 0 if any permit of the key is
held, 1 if none is. Each permit shows its slot, expiry (UTC), time left and
a shortened token, never the whole token (whoever has the token can
release the lock); the key's fence counter (the latest grant's fence) is
shown where the backend keeps one.

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

from .._errors import ArgumentTypeError, InvalidArgumentError
from .args import StatusArgs
from .errors import FREE, OK, USAGE, Failure, backend_errors, one_line
from .holders import Inspection, read_holders
from .progress import short_token, token_prefix
from .urls import connect, parse

__all__ = ["render_json", "render_text", "status"]

STATUS_TIMEOUT = 5.0  # seconds a request may take: status is interactive


def _iso(ms: int) -> str:
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def render_json(args: StatusArgs, found: Inspection) -> str:
    """One JSON object: key, service, limit, held, now, fence, and each holder."""
    holders = [
        {
            "slot": h.slot,
            "token_prefix": token_prefix(h.token),
            "expires_at": _iso(h.expires_ms),
            "expires_ms": h.expires_ms,
            "left_seconds": round(max(0, h.expires_ms - found.now_ms) / 1000, 3),
        }
        for h in found.holders
    ]
    document = {
        "key": args.key,
        "service": args.service,
        "limit": args.limit,
        "held": bool(found.holders),
        "now": _iso(found.now_ms),
        "fence": found.fence,
        "holders": holders,
    }
    return json.dumps(document)


def render_text(args: StatusArgs, found: Inspection) -> str:
    """A heading line, a table of the active permits, and the fence counter."""
    kind = "mutex" if args.limit == 1 else f"semaphore of {args.limit}"
    state = f"held ({len(found.holders)} of {args.limit})" if found.holders else "free"
    lines = [f"{args.key!r} (service {args.service!r}, {kind}): {state}"]
    if found.holders:
        lines.append(f"  {'slot':<6}{'expires (UTC)':<26}{'left':>10}  token")
        for h in found.holders:
            left = f"{max(0, h.expires_ms - found.now_ms) / 1000:.1f} s"
            token = short_token(h.token)
            lines.append(f"  {h.slot:<6}{_iso(h.expires_ms):<26}{left:>10}  {token}")
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
                )
        except (InvalidArgumentError, ArgumentTypeError) as error:
            raise Failure(USAGE, one_line(error)) from None
        finally:
            backend.close()
    stdout.write((render_json(args, found) if args.json else render_text(args, found)) + "\n")
    stdout.flush()
    return OK if found.holders else FREE


def _now_ms() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1000)
