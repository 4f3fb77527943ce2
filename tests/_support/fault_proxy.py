"""A TCP proxy on 127.0.0.1 that injects network faults at seeded random points.

:class:`FaultProxy` listens on a free loopback port and forwards each
connection to an upstream ``host:port`` over a connection of its own. One
background thread serves every connection with :mod:`selectors`; the
context manager starts it, and leaves it stopped and every socket closed.
The thread also stops by itself once ``lifetime`` seconds have passed, so a
test that forgets it cannot leave it running.

The clients the tests drive send one request and wait for its reply, so one
chunk read from a client (one ``recv``) is about one request. While faults
are on (:meth:`FaultProxy.faults`), a :class:`random.Random` seeded by the
test picks one outcome per client chunk (:class:`Fault`):

- ``PASS``: forwarded as it is;
- ``DROP_REQUEST``: swallowed; both connections are closed, the server never
  sees it, the client sees the connection close;
- ``DROP_REPLY``: forwarded; the server's reply is swallowed and both
  connections closed: the server executed the request, the client sees a
  connection error, and a client that retries sends it again;
- ``DELAY``: held for a few milliseconds, then forwarded (later chunks of the
  same connection wait behind it, so the order holds). A client that closes
  its connection meanwhile has what was held dropped with it, unless the
  proxy is made with ``deliver_late=True``: then it is forwarded when its
  delay ends, and the connection closed after it, as bytes a client sent
  before it closed still reach the server over a network, and the FIN
  behind them (``tests/faults/cancellation/test_cancellation.py``: a statement a
  cancellation cut reaches the server late);
- ``CUT``: the connection is torn mid-message, then both sides closed: half
  the time the server gets a prefix of the request (and never executes it),
  the other time the request goes through and the client gets a prefix of
  the reply (the server executed it).

``spare(chunk)`` exempts chunks from faults (the MongoDB test spares the
driver's ``hello`` handshakes and heartbeats). ``calm_after_fault=n`` lets
the next ``n`` faultable chunks after each fault pass: with one proxy per
client, the request a client sends right after a fault (its clean-up, say)
reaches the server. :attr:`FaultProxy.counts` tells the test how many of
each fault were injected.

A blackhole (:attr:`FaultProxy.blackholed`, or the :meth:`FaultProxy.blackhole`
block) is a network that stops answering without saying so, as a host that
vanished does: on every connection open when it starts, and on every one
accepted while it lasts, the proxy forwards nothing more either way. It
reads and drops what either side sends (so that a client's sends never
block), and it closes nothing: no FIN, no RST reaches the client, which
waits for its reply for as long as its own timeouts let it, forever
without one. A connection that the server closes meanwhile is closed on
the server's side only. New connections are accepted and never connected
upstream: the server sees nothing of them. Setting ``blackholed = True``
returns once the proxy thread has applied it, so that no byte crosses
after it returns. A connection blackholed stays so when the blackhole
ends (the bytes it dropped cannot be replayed, so its stream is broken);
connections accepted after that are forwarded again. Stopping the proxy
closes every socket, blackholed ones too: a client hung on one then gets
its connection error. :attr:`FaultProxy.swallowed` counts the chunks the
blackhole dropped.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import random
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType

CHUNK = 65536
JOIN_TIMEOUT = 10.0


class Fault(enum.Enum):
    """What the proxy does with one client chunk."""

    PASS = "pass"
    DROP_REQUEST = "drop_request"
    DROP_REPLY = "drop_reply"
    DELAY = "delay"
    CUT = "cut"


@dataclass(frozen=True)
class Rates:
    """The chance of each fault per client chunk; the rest pass."""

    drop_request: float = 0.0
    drop_reply: float = 0.0
    delay: float = 0.0
    cut: float = 0.0
    delay_seconds: tuple[float, float] = (0.001, 0.010)

    def __post_init__(self) -> None:
        rates = (self.drop_request, self.drop_reply, self.delay, self.cut)
        if any(r < 0 for r in rates) or sum(rates) > 1:
            raise ValueError(f"rates must be >= 0 and sum to at most 1: {self}")
        low, high = self.delay_seconds
        if not 0 <= low <= high:
            raise ValueError(f"delay_seconds must be 0 <= low <= high: {self.delay_seconds}")

    def pick(self, rng: random.Random) -> Fault:
        """One outcome, drawn with ``rng``."""
        draw = rng.random()
        for fault, rate in (
            (Fault.DROP_REQUEST, self.drop_request),
            (Fault.DROP_REPLY, self.drop_reply),
            (Fault.DELAY, self.delay),
            (Fault.CUT, self.cut),
        ):
            if draw < rate:
                return fault
            draw -= rate
        return Fault.PASS


@dataclass(eq=False)
class _Pair:
    """One client connection and the proxy's connection upstream for it."""

    client: socket.socket
    server: socket.socket | None  # None: accepted during a blackhole, never connected upstream
    to_client: bytearray = field(default_factory=bytearray)
    to_server: bytearray = field(default_factory=bytearray)
    held: bytearray = field(default_factory=bytearray)  # client bytes behind a delay
    holding: bool = False
    swallow_reply: bool = False  # DROP_REPLY: close at the first reply byte
    tear_reply: bool = False  # CUT on the reply side
    closed: bool = False
    sunk: bool = False  # blackholed: bytes either way are read and dropped
    ending: bool = False  # the client closed while a chunk was held (deliver_late)
    watching: dict[int, int] = field(default_factory=dict)  # fd -> selector events

    def sockets(self) -> list[socket.socket]:
        """The pair's open sockets: a sunk pair may have none upstream."""
        return [self.client] if self.server is None else [self.client, self.server]


class FaultProxy:
    """A fault-injecting TCP proxy in front of ``upstream``; a context manager.

    ``host`` and ``port`` are where clients connect. Faults start off; turn
    them on and off at any time with :meth:`faults` or :attr:`enabled`. A
    blackhole (:attr:`blackholed`, :meth:`blackhole`) overrides them.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        rates: Rates,
        *,
        seed: int,
        spare: Callable[[bytes], bool] | None = None,
        calm_after_fault: int = 0,
        lifetime: float = 300.0,
        deliver_late: bool = False,
    ) -> None:
        self.upstream = upstream
        self._deliver_late = deliver_late
        self.rates = rates
        self.host = "127.0.0.1"
        self._rng = random.Random(seed)
        self._spare = spare
        self._calm_after_fault = calm_after_fault
        self._calm = 0
        self._lifetime = lifetime
        self._enabled = threading.Event()
        self._blackholed = threading.Event()
        self._applied: list[threading.Event] = []  # blackhole requests the thread has to ack
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._counts: Counter[Fault] = Counter()
        self._chunks = 0
        self._connections = 0
        self._swallowed = 0
        self._errors: list[str] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.host, 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._pairs: set[_Pair] = set()
        self._timers: list[tuple[float, int, _Pair]] = []
        self._sequence = itertools.count()
        self._thread = threading.Thread(target=self._serve, name=f"fault-proxy:{self.port}")
        self._thread.daemon = True

    # --- the test's side ---------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the thread and close every socket; idempotent."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(f"fault proxy on port {self.port} did not stop")

    @property
    def enabled(self) -> bool:
        """Whether faults are injected now."""
        return self._enabled.is_set()

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value:
            self._enabled.set()
        else:
            self._enabled.clear()

    @contextlib.contextmanager
    def faults(self) -> Iterator[FaultProxy]:
        """Inject faults inside the block; none before or after it."""
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False

    @property
    def blackholed(self) -> bool:
        """Whether the proxy is a blackhole now (see the module docstring)."""
        return self._blackholed.is_set()

    @blackholed.setter
    def blackholed(self, value: bool) -> None:
        if not value:
            self._blackholed.clear()  # connections already blackholed stay so
            return
        applied = threading.Event()
        with self._lock:
            self._applied.append(applied)
        self._blackholed.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        # The thread acks at the top of its next loop, after sinking every
        # pair: from then on nothing crosses. A thread that is not running has
        # no pair to sink (one not started yet sinks each one it accepts).
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not applied.wait(0.01):
            if not self._thread.is_alive():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"fault proxy on port {self.port} did not apply the blackhole")

    @contextlib.contextmanager
    def blackhole(self) -> Iterator[FaultProxy]:
        """Be a blackhole inside the block; connections it caught stay dead after it."""
        self.blackholed = True
        try:
            yield self
        finally:
            self.blackholed = False

    @property
    def swallowed(self) -> int:
        """Chunks (either way) read and dropped by the blackhole so far."""
        with self._lock:
            return self._swallowed

    @property
    def counts(self) -> dict[Fault, int]:
        """How many chunks got each outcome so far (PASS included)."""
        with self._lock:
            return {fault: self._counts[fault] for fault in Fault}

    @property
    def injected(self) -> int:
        """How many faults (anything but PASS) were injected so far."""
        counts = self.counts
        return sum(n for fault, n in counts.items() if fault is not Fault.PASS)

    @property
    def chunks(self) -> int:
        """Client chunks forwarded or faulted so far, faults on or off."""
        with self._lock:
            return self._chunks

    @property
    def connections(self) -> int:
        """Client connections accepted so far."""
        with self._lock:
            return self._connections

    @property
    def errors(self) -> list[str]:
        """Unexpected errors inside the proxy thread (a test should expect none)."""
        with self._lock:
            return list(self._errors)

    # --- the thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        ends = time.monotonic() + self._lifetime
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= ends:
                    break
                self._apply_blackhole()
                self._fire_timers(now)
                timeout = min(0.1, ends - now)
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - now))
                for key, events in self._selector.select(timeout):
                    self._on_event(key, events)
        except Exception as error:  # noqa: BLE001 - recorded in errors; the test checks them
            with self._lock:
                self._errors.append(f"{type(error).__name__}: {error}")
        finally:
            for pair in list(self._pairs):
                self._close(pair)
            self._selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _on_event(self, key: selectors.SelectorKey, events: int) -> None:
        sock = key.fileobj
        if sock is self._listener:
            self._accept()
            return
        if sock is self._wake_r:
            with contextlib.suppress(OSError):
                self._wake_r.recv(CHUNK)
            return
        pair = key.data
        assert isinstance(pair, _Pair)
        if pair.closed:
            return
        if pair.sunk:
            assert isinstance(sock, socket.socket)
            self._drain(pair, sock)
            return
        if events & selectors.EVENT_WRITE:
            self._flush(pair)
        if pair.closed or not events & selectors.EVENT_READ:
            return
        if sock is pair.client:
            self._from_client(pair)
        else:
            self._from_server(pair)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._blackholed.is_set():
            # Accepted, never connected upstream: the client waits for ever.
            with self._lock:
                self._connections += 1
            client.setblocking(False)
            pair = _Pair(client, None, sunk=True)
            self._pairs.add(pair)
            self._selector.register(client, selectors.EVENT_READ, pair)
            pair.watching[client.fileno()] = selectors.EVENT_READ
            return
        try:
            server = socket.create_connection(self.upstream, timeout=5.0)
        except OSError:
            client.close()  # upstream down: the client sees its connection close
            return
        with self._lock:
            self._connections += 1
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, server)
        self._pairs.add(pair)
        self._selector.register(client, selectors.EVENT_READ, pair)
        self._selector.register(server, selectors.EVENT_READ, pair)

    def _apply_blackhole(self) -> None:
        """Sink every pair if the proxy is a blackhole; ack the requests that asked for it."""
        with self._lock:
            requests, self._applied = self._applied, []
        if self._blackholed.is_set():
            for pair in list(self._pairs):
                self._sink(pair)
        for applied in requests:
            applied.set()

    def _sink(self, pair: _Pair) -> None:
        """Forward nothing more on ``pair``, either way; drop what it had buffered."""
        if pair.sunk or pair.closed:
            return
        pair.sunk = True
        pair.to_client.clear()
        pair.to_server.clear()
        pair.held.clear()
        pair.holding = False
        pair.swallow_reply = pair.tear_reply = False
        for sock in pair.sockets():
            if pair.watching.get(sock.fileno(), selectors.EVENT_READ) != selectors.EVENT_READ:
                self._selector.modify(sock, selectors.EVENT_READ, pair)
                pair.watching[sock.fileno()] = selectors.EVENT_READ

    def _drain(self, pair: _Pair, sock: socket.socket) -> None:
        """Read and drop a chunk on a sunk pair; a side that closed is closed on its own."""
        try:
            data = sock.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            with self._lock:
                self._swallowed += 1
        elif sock is pair.client:
            self._close(pair)  # the client left: nobody is left to keep in the dark
        else:
            # The server closed: close that side alone, so that the client sees nothing.
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()
            pair.server = None

    def _recv(self, pair: _Pair, sock: socket.socket) -> bytes | None:
        """Bytes read, or None when the peer closed (the pair is then closed, or ending)."""
        try:
            data = sock.recv(CHUNK)
        except BlockingIOError:
            return b""
        except OSError:
            data = b""
        if not data:
            if sock is pair.client and pair.holding and self._deliver_late:
                self._end_late(pair)
            else:
                self._close(pair)
            return None
        return data

    def _end_late(self, pair: _Pair) -> None:
        """The client closed while a chunk was held: forward it when due, then close."""
        pair.ending = True
        pair.to_client.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pair.client)

    def _decide(self, data: bytes) -> Fault:
        with self._lock:
            self._chunks += 1
        if not self._enabled.is_set() or (self._spare is not None and self._spare(data)):
            fault = Fault.PASS
        elif self._calm > 0:
            self._calm -= 1
            fault = Fault.PASS
        else:
            fault = self.rates.pick(self._rng)
            if fault is not Fault.PASS:
                self._calm = self._calm_after_fault
        with self._lock:
            self._counts[fault] += 1
        return fault

    def _from_client(self, pair: _Pair) -> None:
        data = self._recv(pair, pair.client)
        if not data:
            return
        fault = self._decide(data)
        if fault is Fault.DROP_REQUEST:
            self._close(pair)
        elif fault is Fault.DROP_REPLY:
            pair.swallow_reply = True
            self._to_server(pair, data)
        elif fault is Fault.DELAY:
            low, high = self.rates.delay_seconds
            if not pair.holding:
                pair.holding = True
                when = time.monotonic() + self._rng.uniform(low, high)
                heapq.heappush(self._timers, (when, next(self._sequence), pair))
            pair.held += data
        elif fault is Fault.CUT:
            if self._rng.random() < 0.5:
                # The server gets a prefix of the request, then the connection closes.
                assert pair.server is not None  # only a sunk pair loses its server side
                self._to_server(pair, data[: self._rng.randrange(len(data))])
                self._send_now(pair.server, pair.to_server)
                self._close(pair)
            else:
                pair.tear_reply = True
                self._to_server(pair, data)
        else:
            self._to_server(pair, data)

    def _from_server(self, pair: _Pair) -> None:
        assert pair.server is not None  # only a sunk pair loses its server side
        data = self._recv(pair, pair.server)
        if not data:
            return
        if pair.ending:
            return  # the client is gone: nobody to answer
        if pair.swallow_reply:
            self._close(pair)
        elif pair.tear_reply:
            pair.to_client += data[: self._rng.randrange(len(data))]
            self._send_now(pair.client, pair.to_client)
            self._close(pair)
        else:
            pair.to_client += data
            self._flush(pair)

    def _to_server(self, pair: _Pair, data: bytes) -> None:
        if pair.holding:
            pair.held += data  # behind a delayed chunk: keep the order
        else:
            pair.to_server += data
            self._flush(pair)

    def _fire_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, pair = heapq.heappop(self._timers)
            if pair.closed or pair.sunk:
                continue
            pair.holding = False
            pair.to_server += pair.held
            pair.held.clear()
            self._flush(pair)
            if pair.ending and not pair.closed:
                assert pair.server is not None  # only a sunk pair loses its server side
                self._send_now(pair.server, pair.to_server)
                self._close(pair)  # the client's FIN, behind its last bytes

    @staticmethod
    def _send_now(sock: socket.socket, buffer: bytearray) -> None:
        """Send what ``buffer`` holds as far as the socket takes it now (before a close)."""
        with contextlib.suppress(OSError):
            if buffer:
                sent = sock.send(buffer)
                del buffer[:sent]

    def _flush(self, pair: _Pair) -> None:
        """Send what is buffered each way; watch for writability while some is left."""
        for sock, buffer in ((pair.server, pair.to_server), (pair.client, pair.to_client)):
            if sock is None or (pair.ending and sock is pair.client):
                continue
            if buffer:
                try:
                    sent = sock.send(buffer)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._close(pair)
                    return
                del buffer[:sent]
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if buffer else 0)
            if pair.watching.get(sock.fileno(), selectors.EVENT_READ) != events:
                self._selector.modify(sock, events, pair)
                pair.watching[sock.fileno()] = events

    def _close(self, pair: _Pair) -> None:
        if pair.closed:
            return
        pair.closed = True
        self._pairs.discard(pair)
        for sock in pair.sockets():
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()


def upstream_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a ``mongodb://host:port/...`` URL: what a proxy forwards to."""
    netloc = url.removeprefix("mongodb://").split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = netloc.rpartition(":")
    return host, int(port)
