"""etcd as a backend of the behaviour suites: etcd3gw (sync) and aetcd (asyncio) on a real member.

Every lock the suites make keeps its keys under the session's prefix
(``etcd_servers``: ``dmutex-test-<12 hex>/``), so that on a user's etcd
nothing else is touched: :meth:`Etcd.key_prefix` gives each instance the
session's prefix before its own (the library's default, or the one the test
names). What :meth:`Etcd.active` lists, and
what the suites compare with the layout, is named without the session's
prefix.

Expiry is forced as etcd would end a lease: the lease of the slot key is
revoked, which deletes the key.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import etcd3gw

from dmutex import ManualClock
from tests._support.etcd_servers import Endpoint, Session, prefix_end, request

Runner = Callable[[Awaitable[object]], object]

# The prefixes the library gives each kind by default, before the service name.
DEFAULT_PREFIXES = {"mutex": "_dmutex_", "semaphore": "_dsemaphore_", "rwlock": "_drwlock_"}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Etcd:
    """A real etcd member through etcd3gw (sync) or aetcd (asyncio); emptied first."""

    clock: ManualClock | None = None
    # Whole seconds and more are what etcd's leases count; none runs out in a test.
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, session: Session) -> None:
        self._server = session.fresh()
        self._endpoint: Endpoint = self._server.endpoints[0]
        self.namespace = session.prefix
        self._made: list[object] = []

    def key_prefix(self, kind: str, options: dict[str, Any]) -> str:
        """The key prefix an instance made with ``options`` has, under the session's prefix.

        The test's own ``key_prefix``, else the library's default for
        ``kind`` and the service: either after the session's prefix.
        """
        named = options.get("key_prefix")
        if named is None:
            named = f"{DEFAULT_PREFIXES[kind]}{options.get('service_name', 'svc')}:"
        return f"{self.namespace}{named}"

    def client(self, asynchronous: bool) -> object:
        host, port = self._endpoint.host, self._endpoint.port
        made: object
        if asynchronous:
            made = aetcd.Client(host=host, port=port, timeout=10)
        else:
            made = etcd3gw.Etcd3Client(host=host, port=port, timeout=10)
        self._made.append(made)
        return made

    def _records(self, prefix: str) -> list[dict[str, Any]]:
        """The keys under ``prefix`` (within the session's), with their values and leases."""
        start = f"{self.namespace}{prefix}".encode()
        body = {"key": _b64(start), "range_end": _b64(prefix_end(start))}
        found = request(self._endpoint, "/v3/kv/range", body).get("kvs") or []
        return [
            {
                "key": base64.b64decode(kv["key"]).decode()[len(self.namespace) :],
                "value": base64.b64decode(kv.get("value", "")).decode(),
                "lease": int(kv.get("lease", 0)),
            }
            for kv in found
        ]

    def force_expire(self, key: str, slot: int | None = None) -> None:
        pattern = re.compile(rf"permit:{'[0-9]+' if slot is None else slot}:{re.escape(key)}\Z")
        for record in self._records(""):
            if pattern.search(record["key"]) and record["lease"]:
                request(self._endpoint, "/v3/kv/lease/revoke", {"ID": record["lease"]})

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` end now, as its lease's expiry would."""
        name = key.encode()
        base = f"rwlock:{len(name)}:".encode() + name + b":"
        for record in self._records(""):
            if base in record["key"].encode() and record["value"] == token and record["lease"]:
                request(self._endpoint, "/v3/kv/lease/revoke", {"ID": record["lease"]})

    def active(self, prefix: str) -> dict[str, str]:
        return {
            record["key"]: record["value"]
            for record in self._records(prefix)
            if record["key"].startswith(f"{prefix}permit:")
        }

    def close(self, run: Runner | None) -> None:
        for made in self._made:
            if isinstance(made, aetcd.Client):
                if run is not None:
                    run(made.close())
            elif isinstance(made, etcd3gw.Etcd3Client):
                made.session.close()
        self._made.clear()
