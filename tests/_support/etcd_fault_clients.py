"""etcd clients for the fault tests: aetcd wrapped around each request, and etcd3gw's ``post``.

Every wrapper here has the shape by which dmutex tells an etcd client
(``dmutex/_backends/etcd/shapes.py``) and nothing else: the aetcd ones
define aetcd's request methods on the class as coroutine functions (so
that an asyncio class takes them and a sync class refuses them) and carry
the real client's ``transactions`` builders as an attribute; the gateway one
defines etcd3gw's ``get_url``, ``post`` and ``watch_once`` as plain methods.
Each hands every request to the real client at a moment of its choosing:

- :class:`DelayingEtcd` (``tests/faults/cancellation/test_etcd_cancellation.py``), the etcd
  twin of :class:`~tests._support.fault_clients.DelayingRedis`: a random
  short sleep before a request is handed to aetcd and another after its
  reply came back, each of :data:`~tests._support.fault_clients.PHASES`
  noted (and :data:`RAISED` when aetcd raised its own error), so that a
  test can tell whether a cancellation landed before the request was sent,
  while aetcd awaited the server, or after the server answered but before
  dmutex had the reply;
- :class:`GatedEtcd` (``tests/faults/cancellation/test_etcd_holes.py``, hole 1): a held
  request runs on the server and its reply waits until the test opens the
  gate, as ``GatedRedis``'s does; or it waits there before it is sent;
- :class:`LosingEtcd` (holes 2 and 8): the next request of a named method
  reaches the server and its reply is lost: aetcd's ``ConnectionFailedError``
  is raised in its place, or the request is sent again and the second copy's
  reply returned (a client that re-sends after a dropped connection);
- :class:`ResendingGateway` (hole 8 on the sync face): an etcd3gw client
  whose next ``post`` to a named API path is sent twice, the first reply
  lost.

Each aetcd wrapper lists the requests that reached the server, by method
name, in :attr:`EtcdWrapper.sent` (a watch is counted as it is handed over).

And what the tests read behind dmutex's back, through the gateway with the
harness's plain HTTP (``etcd_servers.request``): the keys under a prefix
(:func:`records_under`, :func:`keys_under`), the server's revision
(:func:`revision`), the leases it holds (:func:`live_leases`) and the keys
of one (:func:`lease_keys`); :func:`revoke` ends a lease.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import urllib.error
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import aetcd
import etcd3gw

from tests._support.etcd_servers import Endpoint, prefix_end, request
from tests._support.fault_clients import PHASES

T = TypeVar("T")

Arguments = Mapping[str, object]
"""A request's arguments by parameter name (``lease_id``, ``success``, ...)."""


class EtcdWrapper:
    """aetcd's request methods, each handing its request to :meth:`_request`.

    ``sent`` lists the method of each request handed to the real client, in
    order (a request that a wrapper sends twice is listed twice); ``leases``
    the lease ID of each grant asked for (dmutex's own: ``leases.lease_id``).
    """

    def __init__(self, inner: aetcd.Client) -> None:
        self.inner = inner
        # An attribute, as aetcd's own: dmutex builds its transactions with it.
        self.transactions = inner.transactions
        self.sent: list[str] = []
        self.leases: list[int] = []

    async def _request(
        self, name: str, arguments: Arguments, call: Callable[[], Awaitable[T]]
    ) -> T:
        """Send one request (``call()`` sends it on the real client); its reply."""
        self.sent.append(name)
        return await call()

    async def lease(self, ttl: int, /, lease_id: int | None = None) -> aetcd.Lease:
        inner = self.inner
        if lease_id is not None:
            self.leases.append(lease_id)
        arguments = {"ttl": ttl, "lease_id": lease_id}
        return await self._request("lease", arguments, lambda: inner.lease(ttl, lease_id=lease_id))

    async def refresh_lease(self, lease_id: int, /) -> Any:
        inner = self.inner
        arguments = {"lease_id": lease_id}
        return await self._request(
            "refresh_lease", arguments, lambda: inner.refresh_lease(lease_id)
        )

    async def revoke_lease(self, lease_id: int, /) -> Any:
        inner = self.inner
        arguments = {"lease_id": lease_id}
        return await self._request("revoke_lease", arguments, lambda: inner.revoke_lease(lease_id))

    async def get_lease_info(self, lease_id: int, /, *, keys: bool = True) -> Any:
        inner = self.inner
        arguments = {"lease_id": lease_id, "keys": keys}
        return await self._request(
            "get_lease_info", arguments, lambda: inner.get_lease_info(lease_id, keys=keys)
        )

    async def transaction(
        self, compare: list[object], success: list[object], failure: list[object]
    ) -> tuple[bool, list[Any]]:
        inner = self.inner
        arguments = {"compare": compare, "success": success, "failure": failure}
        return await self._request(
            "transaction", arguments, lambda: inner.transaction(compare, success, failure)
        )

    async def get_prefix(self, key_prefix: bytes, /, *, keys_only: bool = False) -> aetcd.GetRange:
        inner = self.inner
        arguments = {"key_prefix": key_prefix, "keys_only": keys_only}
        return await self._request(
            "get_prefix", arguments, lambda: inner.get_prefix(key_prefix, keys_only=keys_only)
        )

    async def watch_once(
        self,
        key: bytes,
        /,
        timeout: float | None = None,
        *,
        start_revision: int | None = None,
        range_end: bytes | None = None,
    ) -> Any:
        # aetcd's stub leaves range_end out; its client takes it (the read-write store's ranges).
        watch: Callable[..., Awaitable[Any]] = self.inner.watch_once
        arguments = {"key": key, "timeout": timeout, "start_revision": start_revision}
        options: dict[str, object] = {"timeout": timeout, "start_revision": start_revision}
        if range_end is not None:
            options["range_end"] = range_end
        return await self._request("watch_once", arguments, lambda: watch(key, **options))


# --- the delaying wrapper -----------------------------------------------------------


RAISED = "raised"
"""What :class:`DelayingEtcd` says when aetcd's call ended with an error other than a
cancellation: the server refused, or a watch timed out. No phase follows."""


class DelayingEtcd(EtcdWrapper):
    """An aetcd client that sleeps before and after each request, noting its phases.

    Each sleep lasts ``uniform(0, max_delay)`` seconds from ``rng``.
    ``on_phase(method, phase)`` is called as each phase of a request begins
    (one of :data:`~tests._support.fault_clients.PHASES`), with
    :data:`RAISED` when aetcd's call raised anything but a cancellation (a
    refusal, a watch's timeout), and with phase None when the request is
    over, however it ended; ``on_send(method,
    arguments)`` as it is handed to the real client. ``counts`` counts the
    requests handed over, by method.
    """

    def __init__(
        self,
        inner: aetcd.Client,
        rng: random.Random,
        max_delay: float,
        on_send: Callable[[str, Arguments], None],
        on_phase: Callable[[str, str | None], None],
    ) -> None:
        super().__init__(inner)
        self._rng = rng
        self._max_delay = max_delay
        self._on_send = on_send
        self._on_phase = on_phase
        self.counts: Counter[str] = Counter()

    async def _request(
        self, name: str, arguments: Arguments, call: Callable[[], Awaitable[T]]
    ) -> T:
        before, in_flight, after = PHASES
        try:
            self._on_phase(name, before)
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
            self._on_phase(name, in_flight)
            self.counts[name] += 1
            self._on_send(name, arguments)
            try:
                reply = await call()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._on_phase(name, RAISED)
                raise
            self._on_phase(name, after)
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
        finally:
            self._on_phase(name, None)
        return reply


# --- the gate: a reply held --------------------------------------------------------------


class GatedEtcd(EtcdWrapper):
    """The next request of a method named by :meth:`hold` waits for :attr:`gate`.

    ``before=False`` (as ``GatedRedis``): the request runs on the server,
    :attr:`arrived` is set, and its reply is returned once :attr:`gate` is
    set: the moment a cancellation can land between "done on the server" and
    "reply read". ``before=True``: :attr:`arrived` is set and the request
    waits for :attr:`gate` before it is handed to aetcd: a cancellation then
    lands before anything was sent. :attr:`sent` lists what reached aetcd.
    """

    def __init__(self, inner: aetcd.Client) -> None:
        super().__init__(inner)
        self._held: tuple[str, bool] | None = None
        self.arrived = asyncio.Event()
        self.gate = asyncio.Event()

    def hold(self, method: str, *, before: bool = False) -> None:
        self._held = (method, before)
        self.arrived.clear()
        self.gate.clear()

    async def _request(
        self, name: str, arguments: Arguments, call: Callable[[], Awaitable[T]]
    ) -> T:
        held = self._held
        if held is None or held[0] != name:
            return await super()._request(name, arguments, call)
        self._held = None
        if held[1]:
            self.arrived.set()
            await self.gate.wait()
        reply = await super()._request(name, arguments, call)
        if not held[1]:
            self.arrived.set()
            await self.gate.wait()
        return reply


# --- a reply lost --------------------------------------------------------------------------


class LosingEtcd(EtcdWrapper):
    """The next request of a method named by :meth:`lose` reaches the server; its reply is lost.

    ``resend=False``: aetcd's ``ConnectionFailedError`` is raised in the
    reply's place (a connection dropped after the server applied the
    request). ``resend=True``: the same request is sent again and the
    second copy's reply returned, whatever the first answered (a client that
    re-sends after a dropped connection). ``lost`` counts the replies lost.
    """

    def __init__(self, inner: aetcd.Client) -> None:
        super().__init__(inner)
        self._losing: tuple[str, bool] | None = None
        self.lost = 0

    def lose(self, method: str, *, resend: bool) -> None:
        self._losing = (method, resend)

    async def _request(
        self, name: str, arguments: Arguments, call: Callable[[], Awaitable[T]]
    ) -> T:
        self.sent.append(name)
        losing = self._losing
        if losing is None or losing[0] != name:
            return await call()
        self._losing = None
        # Applied on the server, its reply never arrives; a refusal is lost all the same (a
        # copy meets the same state).
        with contextlib.suppress(aetcd.ClientError):
            await call()
        self.lost += 1
        if not losing[1]:
            raise aetcd.ConnectionFailedError("the connection dropped before the reply (a test)")
        self.sent.append(name)
        return await call()


# --- etcd3gw, a post re-sent ----------------------------------------------------------------


class ResendingGateway:
    """An etcd3gw client whose next ``post`` to the API path named by :meth:`resend` is sent
    twice, the first reply lost (a client or proxy that re-sends after a dropped connection).

    ``posts`` lists the API path of each ``post`` sent, in order; ``resends`` counts the
    replies lost.
    """

    def __init__(self, inner: etcd3gw.Etcd3Client) -> None:
        self._inner = inner
        self._resend: str | None = None
        self.posts: list[str] = []
        self.resends = 0

    def resend(self, path: str) -> None:
        """Send the next ``post`` to ``path`` (``/kv/lease/revoke``) twice."""
        self._resend = self._inner.get_url(path)

    def get_url(self, path: str, /) -> str:
        return self._inner.get_url(path)

    def post(self, url: str, /, *, json: Mapping[str, object]) -> object:
        path = url.removeprefix(self._inner.get_url(""))
        if url == self._resend:
            self._resend = None
            self.posts.append(path)
            # Applied on the server, its reply never arrives; a refusal is lost all the same.
            with contextlib.suppress(etcd3gw.exceptions.Etcd3Exception):
                self._inner.post(url, json=json)
            self.resends += 1
        self.posts.append(path)
        reply: object = self._inner.post(url, json=json)
        return reply

    def watch_once(self, key: bytes, /, timeout: float, **options: Any) -> object:
        event: object = self._inner.watch_once(key, timeout, **options)
        return event


# --- reading the server behind dmutex's back -------------------------------------------------


@dataclass(frozen=True)
class Kv:
    """A key as etcd holds it: its value, its lease (0: none), the revision that created it."""

    value: str
    lease: int
    create_revision: int


def records_under(endpoint: Endpoint, prefix: str) -> dict[str, Kv]:
    """Every key under ``prefix`` (a linearizable read through the gateway)."""
    start = prefix.encode()
    body = {"key": _b64(start), "range_end": _b64(prefix_end(start))}
    found = request(endpoint, "/v3/kv/range", body).get("kvs") or []
    return {
        base64.b64decode(kv["key"]).decode(): Kv(
            base64.b64decode(kv.get("value", "")).decode(),
            int(kv.get("lease", 0)),
            int(kv.get("create_revision", 0)),
        )
        for kv in found
    }


def keys_under(endpoint: Endpoint, prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` and its value."""
    return {name: kv.value for name, kv in records_under(endpoint, prefix).items()}


def revision(endpoint: Endpoint) -> int:
    """The server's revision now: it moves with every change, anywhere."""
    body = {"key": _b64(b"\x00"), "count_only": True}
    return int(request(endpoint, "/v3/kv/range", body)["header"]["revision"])


def live_leases(endpoint: Endpoint) -> set[int]:
    """The IDs of every lease the server holds now (etcd's ``LeaseLeases``)."""
    found = request(endpoint, "/v3/lease/leases", {}).get("leases") or []
    return {int(lease["ID"]) for lease in found}


def lease_keys(endpoint: Endpoint, lease: int) -> list[str] | None:
    """The keys attached to ``lease``; None if it is gone (etcd's ``LeaseTimeToLive``)."""
    body = request(endpoint, "/v3/kv/lease/timetolive", {"ID": lease, "keys": True})
    if int(body.get("TTL", -1)) <= 0:
        return None
    return [base64.b64decode(key).decode() for key in body.get("keys") or []]


def revoke(endpoint: Endpoint, lease: int) -> None:
    """Revoke ``lease`` (deleting its keys); one already gone is no error."""
    try:
        request(endpoint, "/v3/kv/lease/revoke", {"ID": lease})
    except urllib.error.HTTPError as error:
        if error.code != HTTPStatus.NOT_FOUND:
            raise


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
