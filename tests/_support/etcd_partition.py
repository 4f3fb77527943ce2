"""A three-member etcd cluster whose peer links the test can cut: one member from the others.

:class:`ProxiedCluster` is ``etcd_servers.Cluster`` with one change: each
member listens for its peers on its own peer port, but advertises (and is
named in ``--initial-cluster`` by) the port of a proxy of the
:class:`Switchboard`, which forwards to it. Every byte between members then
crosses the switchboard, and nothing else does: clients talk to the
members' client ports directly. Everything else (ports, folders, pids,
kill, start, the leader) is ``Cluster``'s.

The switchboard knows which member dialed each connection it accepts: etcd
identifies peers inside its HTTP requests only, so the proxy asks the
kernel instead (``/proc/net/tcp`` names the dialing socket's inode, and the
member whose ``/proc/PID/fd`` holds that inode dialed). :meth:`Switchboard.cut`
of member ``i`` blackholes every link to and from ``i``, as
``fault_proxy.FaultProxy``'s blackhole does one proxy: the open connections
stay open and carry nothing more either way (their bytes are read and
dropped, so that no sender blocks; nothing is closed, so no FIN or RST
tells anyone), and new ones are accepted and never connected upstream.
The links between the other members are untouched. A connection whose
dialer cannot be named during a cut (it closed before it was looked up) is
blackholed too: letting ``i`` through would be worse than a lost link,
which etcd redials. :meth:`Switchboard.heal` ends the cut and closes the
blackholed connections: their streams lost bytes and cannot resume, and
closing them makes the members redial at once rather than after etcd's
5 s read timeout.

Everything is on 127.0.0.1; one thread serves every proxy and stops with
:meth:`Switchboard.stop`, or by itself after ``lifetime`` seconds.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._support import etcd_servers
from tests._support.servers import LOOPBACK

CHUNK = 65536
JOIN_TIMEOUT = 10.0
CONNECT_TIMEOUT = 2.0  # upstream is a loopback port: it accepts or refuses at once


def _hex_address(port: int) -> str:
    """127.0.0.1:``port`` as ``/proc/net/tcp`` writes it (the address little-endian)."""
    return f"0100007F:{port:04X}"


def dialer(local_port: int, remote_port: int, pids: Mapping[int, int]) -> int | None:
    """Which of ``pids`` (index -> pid) owns the socket 127.0.0.1:``local_port`` ->
    127.0.0.1:``remote_port``; None if none does (or it is gone)."""
    local, remote = _hex_address(local_port), _hex_address(remote_port)
    inode = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[1] == local and fields[2] == remote:
                inode = fields[9]
                break
    if inode is None or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for index, pid in pids.items():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return index
    return None


@dataclass(eq=False)
class _Link:
    """One peer connection: the dialer's side, and the proxy's connection to the member."""

    client: socket.socket
    server: socket.socket | None  # None: accepted during a cut, never connected upstream
    origin: int | None  # the member that dialed, if known
    target: int  # the member it goes to
    to_client: bytearray = field(default_factory=bytearray)
    to_server: bytearray = field(default_factory=bytearray)
    sunk: bool = False
    closed: bool = False
    events: dict[int, int] = field(default_factory=dict)  # fd -> what the selector watches

    def sockets(self) -> list[socket.socket]:
        return [self.client] if self.server is None else [self.client, self.server]

    def touches(self, member: int) -> bool:
        """Whether the link is to or from ``member`` (or from a dialer that was not named)."""
        return self.target == member or self.origin in (member, None)


class Switchboard:
    """One proxy per member's peer port; :meth:`cut` blackholes one member's links."""

    def __init__(
        self,
        upstreams: Sequence[int],
        pids: Callable[[], Mapping[int, int]],
        *,
        lifetime: float = 300.0,
    ) -> None:
        self._upstreams = list(upstreams)
        self._pids = pids
        self._lifetime = lifetime
        self._lock = threading.Lock()
        self._cut: int | None = None
        self._requests: list[tuple[str, threading.Event]] = []
        self._stop = threading.Event()
        self._errors: list[str] = []
        self._named = 0
        self._unnamed = 0
        self._selector = selectors.DefaultSelector()
        self._links: set[_Link] = set()
        self._listeners: list[socket.socket] = []
        for _ in upstreams:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((LOOPBACK, 0))
            listener.listen(64)
            listener.setblocking(False)
            self._listeners.append(listener)
        self.ports: list[int] = [listener.getsockname()[1] for listener in self._listeners]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="etcd-switchboard", daemon=True)

    # --- the test's side ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close every socket; idempotent."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError("the etcd switchboard did not stop")

    @property
    def errors(self) -> list[str]:
        """Unexpected errors of the proxy thread (a test expects none)."""
        with self._lock:
            return list(self._errors)

    @property
    def named(self) -> int:
        """Connections whose dialer was named: the kernel's tables were read as expected."""
        with self._lock:
            return self._named

    @property
    def unnamed(self) -> int:
        """Connections whose dialer could not be named (blackholed if a cut was on)."""
        with self._lock:
            return self._unnamed

    @property
    def cut_member(self) -> int | None:
        with self._lock:
            return self._cut

    def cut(self, member: int) -> None:
        """Blackhole every link to and from ``member``; returns once nothing crosses them."""
        with self._lock:
            self._cut = member
        self._ask("cut")

    def heal(self) -> None:
        """End the cut: new links are forwarded again, the blackholed ones closed."""
        with self._lock:
            self._cut = None
        self._ask("heal")

    def _ask(self, what: str) -> None:
        """Have the thread apply ``what`` at the top of its next turn, and wait for it."""
        done = threading.Event()
        with self._lock:
            self._requests.append((what, done))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not done.wait(0.01):
            if not self._thread.is_alive():
                return  # not serving: no link to act on
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd switchboard did not apply {what!r}")

    # --- the thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        ends = time.monotonic() + self._lifetime
        for index, listener in enumerate(self._listeners):
            self._selector.register(listener, selectors.EVENT_READ, index)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set() and time.monotonic() < ends:
                self._apply()
                for key, events in self._selector.select(0.1):
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(CHUNK)
                    elif isinstance(key.data, int):
                        self._accept(key.data)
                    else:
                        link, side = key.data
                        self._on_event(link, side, events)
        except Exception as error:  # noqa: BLE001 - kept in errors; the test checks them
            with self._lock:
                self._errors.append(f"{type(error).__name__}: {error}")
        finally:
            for link in list(self._links):
                self._close(link)
            self._selector.close()
            for sock in (*self._listeners, self._wake_r, self._wake_w):
                sock.close()

    def _apply(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
            cut = self._cut
        for what, done in requests:
            if what == "cut" and cut is not None:
                for link in list(self._links):
                    if link.touches(cut):
                        self._sink(link)
            elif what == "heal":
                for link in [link for link in self._links if link.sunk]:
                    self._close(link)
            done.set()

    def _accept(self, target: int) -> None:
        try:
            client, (_, port) = self._listeners[target].accept()
        except BlockingIOError:
            return
        try:
            pids = self._pids()
        except Exception:  # noqa: BLE001 - a member stopping meanwhile: named by the others
            pids = {}
        origin = dialer(port, self.ports[target], pids)
        client.setblocking(False)
        with self._lock:
            cut = self._cut
            self._named += origin is not None
            self._unnamed += origin is None
        link = _Link(client, None, origin, target)
        if cut is not None and link.touches(cut):
            link.sunk = True  # accepted, never connected upstream: the dialer waits
        else:
            try:
                server = socket.create_connection(
                    (LOOPBACK, self._upstreams[target]), timeout=CONNECT_TIMEOUT
                )
            except OSError:
                client.close()  # the member is down: the dialer sees its connection close
                return
            server.setblocking(False)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link.server = server
        self._links.add(link)
        for end, side in ((link.client, "client"), (link.server, "server")):
            if end is not None:
                self._selector.register(end, selectors.EVENT_READ, (link, side))
                link.events[end.fileno()] = selectors.EVENT_READ

    def _on_event(self, link: _Link, side: str, events: int) -> None:
        if link.closed:
            return
        sock = link.client if side == "client" else link.server
        if sock is None:
            return
        if events & selectors.EVENT_WRITE and not link.sunk and not self._flush(link):
            return
        if not events & selectors.EVENT_READ:
            return
        try:
            data = sock.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if link.sunk:
            if not data:
                self._close_side(link, sock)
            return  # read and dropped: the blackhole
        if not data:
            self._close(link)
            return
        if side == "client":
            link.to_server += data
        else:
            link.to_client += data
        self._flush(link)

    def _flush(self, link: _Link) -> bool:
        """Send what is buffered each way, watching for writability while some is left;
        whether the link is still open."""
        for sock, buffer in ((link.server, link.to_server), (link.client, link.to_client)):
            if sock is None:
                continue
            if buffer:
                try:
                    sent = sock.send(buffer)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._close(link)
                    return False
                del buffer[:sent]
            self._watch(link, sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if buffer else 0))
        return True

    def _watch(self, link: _Link, sock: socket.socket, events: int) -> None:
        if link.events.get(sock.fileno()) != events:
            self._selector.modify(
                sock, events, (link, "client" if sock is link.client else "server")
            )
            link.events[sock.fileno()] = events

    def _sink(self, link: _Link) -> None:
        """Forward nothing more on ``link``, either way; drop what it had buffered."""
        if link.sunk or link.closed:
            return
        link.sunk = True
        link.to_client.clear()
        link.to_server.clear()
        for sock in link.sockets():
            self._watch(link, sock, selectors.EVENT_READ)

    def _close_side(self, link: _Link, sock: socket.socket) -> None:
        """On a blackholed link: the dialer leaving closes it; the member's side closes alone."""
        if sock is link.client:
            self._close(link)
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()
        link.server = None

    def _close(self, link: _Link) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        for sock in link.sockets():
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()


class ProxiedCluster(etcd_servers.Cluster):
    """``etcd_servers.Cluster`` whose members reach each other only through a :class:`Switchboard`.

    Each member listens for peers on its own peer port and advertises its
    proxy's; :meth:`cut` and :meth:`heal` act on the switchboard, which
    :meth:`close` stops after the members.
    """

    def __init__(
        self,
        etcd: Path,
        size: int = 3,
        *,
        heartbeat_ms: int | None = None,
        election_ms: int | None = None,
    ) -> None:
        super().__init__(etcd, size, heartbeat_ms=heartbeat_ms, election_ms=election_ms)
        self.board = Switchboard([member.peer_port for member in self.members], self._member_pids)
        self.board.start()

    def _member_pids(self) -> dict[int, int]:
        """The pid of each member that runs, by index (read by the switchboard's thread)."""
        found: dict[int, int] = {}
        for i, member in enumerate(self.members):
            with contextlib.suppress(RuntimeError):  # stopped meanwhile
                found[i] = member.process.pid
        return found

    def _command(self, member: etcd_servers.Member) -> Callable[[Path, int], list[str]]:
        ports = dict(zip((other.name for other in self.members), self.board.ports, strict=True))

        def command(folder: Path, port: int) -> list[str]:
            made = etcd_servers.member_command(
                self.etcd,
                member.name,
                folder,
                port,
                ports[member.name],
                ports,
                self.token,
                heartbeat_ms=self.heartbeat_ms,
                election_ms=self.election_ms,
            )
            # Advertised (and named to the others): the proxy's port; listened on: its own.
            made[made.index("--listen-peer-urls") + 1] = etcd_servers.peer_url(member.peer_port)
            return made

        return command

    def cut(self, member: int) -> None:
        """Cut member ``member`` off from the others (its clients still reach it)."""
        self.board.cut(member)

    def heal(self) -> None:
        """End the cut."""
        self.board.heal()

    def close(self) -> None:
        """Stop every member by its pid and remove the folders, then stop the switchboard."""
        try:
            super().close()
        finally:
            self.board.stop()


@contextlib.contextmanager
def partitioned_cluster(size: int = 3) -> Iterator[ProxiedCluster]:
    """A new :class:`ProxiedCluster`, started, with a leader; closed (by pid) after.

    From the executable, as ``etcd_servers.fresh_cluster``; no executable: a
    skip saying why (a failure under ``DMUTEX_REQUIRE_ETCD``).
    """
    etcd = etcd_servers.find_etcd()
    if etcd is None:
        if etcd_servers.required():
            raise RuntimeError(
                f"{etcd_servers.REQUIRE} is set, but {etcd_servers.no_cluster_reason()}"
            )
        pytest.skip(etcd_servers.no_cluster_reason())
    cluster = ProxiedCluster(etcd, size)
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.close()
