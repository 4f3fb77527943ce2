"""A Redis primary, two replicas and three Sentinels on loopback, for the failover test.

:class:`SentinelSetup` starts three ``redis-server`` data processes (one
primary, two ``--replicaof`` it) and three Sentinels (``redis-server
<sentinel.conf> --sentinel``) that monitor the primary as :data:`MASTER`
with quorum 2. Every process is a :class:`~tests._support.servers.ServerProcess`
on a free 127.0.0.1 port with a folder of its own, persistence off (no RDB,
no AOF; the initial sync is diskless, without delay). Every signal goes to a
pid the setup started, never to a name.

The timings are small so that a failover takes a second or two: a primary
is subjectively down after :data:`DOWN_AFTER_MS` without a reply, and a
failover that stalls gives up after :data:`FAILOVER_TIMEOUT_MS`.

The faults it offers:

- :meth:`SentinelSetup.kill_primary`: SIGKILL of the primary's pid, which
  loses whatever it had not sent to a replica;
- :meth:`SentinelSetup.pause_replicas` / :meth:`SentinelSetup.resume_replicas`:
  SIGSTOP / SIGCONT of both replicas' pids;
- :meth:`SentinelSetup.cut_replica_links`: the primary drops its replicas'
  connections. With the replicas paused, that is a stalled replication link:
  the primary keeps accepting writes and none reaches a replica (paused,
  they cannot reconnect), where pausing alone would not do on loopback (the
  kernel buffers the primary's writes for the paused replica, which reads
  them once resumed);
- :meth:`SentinelSetup.restart_killed_as_replica`: the killed server started
  again on its port, empty, with ``--replicaof`` the new primary, so that the
  next failover again has two replicas to choose from.

:meth:`SentinelSetup.wait_ready` returns once the primary's writes reach both
replicas and every Sentinel knows the two others, the primary and two
healthy replicas: the state a failover needs. :meth:`SentinelSetup.stop`
resumes what is paused and stops every process by its pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis

from tests._support import redis_servers, servers
from tests._support.redis_replicated import ARGS as DATA_ARGS
from tests._support.servers import LOOPBACK

MASTER = "dmutex-failover"  # the name the Sentinels monitor the primary under
QUORUM = 2
DOWN_AFTER_MS = 1100
FAILOVER_TIMEOUT_MS = 2000
READY_TIMEOUT = 30.0  # wait_ready's bound, on a busy 2-core machine
FAILOVER_WAIT = 30.0  # wait_for_new_primary's bound
PROBE_KEY = "dmutex-tests:sentinel-probe"
ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)


def sentinel_conf(folder: Path, port: int, primary_port: int) -> Path:
    """Write a Sentinel's configuration into ``folder``; its path.

    The Sentinel rewrites the file as it learns (its id, the other
    Sentinels, the replicas), so it lives in the Sentinel's own folder.
    """
    path = folder / "sentinel.conf"
    path.write_text(
        "\n".join(
            [
                f"port {port}",
                f"bind {LOOPBACK}",
                "daemonize no",
                f"dir {folder}",
                "sentinel resolve-hostnames no",
                # Addresses as the clients reach them: no guessing of an interface.
                f"sentinel announce-ip {LOOPBACK}",
                f"sentinel announce-port {port}",
                f"sentinel monitor {MASTER} {LOOPBACK} {primary_port} {QUORUM}",
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}",
                # Both replicas move to the new primary at once: the next
                # failover needs them, and the restarted one is empty anyway.
                f"sentinel parallel-syncs {MASTER} 2",
                "",
            ]
        )
    )
    return path


def _flags(state: dict[str, Any]) -> set[str]:
    """The flags of a Sentinel's description of an instance (a string in RESP2, a set in RESP3)."""
    flags = state.get("flags", "")
    return set(flags) if isinstance(flags, set) else set(str(flags).split(","))


def _master(client: redis.Redis) -> dict[str, Any]:
    """What the Sentinel ``client`` says of :data:`MASTER`, as redis-py parses it."""
    state = client.sentinel_master(MASTER)
    if not isinstance(state, dict):  # typed dict | bool: False is no answer
        raise redis.ResponseError(f"no description of {MASTER}: {state!r}")
    return state


def _command(client: redis.Redis, *args: str) -> Any:
    """``client.execute_command(*args)``: a command redis-py has no typed method for."""
    # redis-py leaves execute_command unannotated: called as a Callable.
    send: Callable[..., Any] = client.execute_command
    return send(*args)


def _replicas(client: redis.Redis) -> list[dict[str, Any]]:
    """What the Sentinel ``client`` says of the primary's replicas."""
    found: list[dict[str, Any]] = client.sentinel_slaves(MASTER)
    return found


class SentinelSetup:
    """Three data servers and three Sentinels of ``executable``; :meth:`start` runs them."""

    def __init__(self, executable: Path) -> None:
        self.executable = executable
        # keep=True: a killed server restarts on the same port (its folder stays too).
        self.data = [
            servers.ServerProcess(f"failover-redis-{i}", keep=True, stop_timeout=10)
            for i in range(3)
        ]
        self.sentinels = [
            servers.ServerProcess(f"failover-sentinel-{i}", stop_timeout=10) for i in range(3)
        ]
        self.primary_port = self.data[0].port
        self.killed: servers.ServerProcess | None = None
        self._paused: list[servers.ServerProcess] = []

    # --- start and stop -------------------------------------------------------------------

    def start(self) -> None:
        """Start the primary, the replicas and the Sentinels; return once :meth:`wait_ready`."""
        try:
            self._start_data(self.data[0])
            for process in self.data[1:]:
                self._start_data(process, self.primary_port)
            for sentinel in self.sentinels:
                self._start_sentinel(sentinel)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start_data(self, process: servers.ServerProcess, primary: int | None = None) -> None:
        extra = ("--replicaof", LOOPBACK, str(primary)) if primary is not None else ()
        redis_servers.start_redis(
            process,
            lambda folder, port: redis_servers.command(
                self.executable, port, folder, *DATA_ARGS, *extra
            ),
            what=f"{process.name} ({self.executable})",
        )

    def _start_sentinel(self, process: servers.ServerProcess) -> None:
        redis_servers.start_redis(
            process,
            lambda folder, port: [
                str(self.executable),
                str(sentinel_conf(folder, port, self.primary_port)),
                "--sentinel",
            ],
            what=f"{process.name} ({self.executable} --sentinel)",
        )

    def stop(self) -> None:
        """Resume what is paused, then stop every process by its pid and remove the folders."""
        with contextlib.suppress(Exception):
            self.resume_replicas()
        for process in [*self.sentinels, *self.data]:
            with contextlib.suppress(Exception):
                process.close()

    # --- clients --------------------------------------------------------------------------

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of each Sentinel, as redis-py's ``Sentinel`` takes them."""
        return [(LOOPBACK, s.port) for s in self.sentinels]

    @contextlib.contextmanager
    def _client(self, port: int, timeout: float = 2.0) -> Iterator[redis.Redis]:
        client = redis.Redis(LOOPBACK, port, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            yield client
        finally:
            client.close()

    def _process_on(self, port: int) -> servers.ServerProcess:
        for process in self.data:
            if process.port == port:
                return process
        raise RuntimeError(f"no data server of this setup listens on {port}")

    def primary(self) -> int:
        """The primary's port, as the first Sentinel that answers names it."""
        for sentinel in self.sentinels:
            with contextlib.suppress(*ERRORS), self._client(sentinel.port) as client:
                reply = _command(client, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
                if reply:
                    return int(reply[1])
        raise RuntimeError("no Sentinel names a primary")

    @property
    def replicas(self) -> list[servers.ServerProcess]:
        """The data servers running now that are not the primary."""
        return [p for p in self.data if p.port != self.primary_port and p.running]

    # --- faults ---------------------------------------------------------------------------

    def kill_primary(self) -> int:
        """SIGKILL the primary by its pid, and wait until it is gone; its port."""
        process = self._process_on(self.primary_port)
        process.kill()
        self.killed = process
        return process.port

    def pause_replicas(self) -> None:
        """SIGSTOP both replicas by their pids: nothing the primary writes reaches them."""
        for process in self.replicas:
            os.kill(process.pid, signal.SIGSTOP)
            self._paused.append(process)

    def cut_replica_links(self) -> None:
        """Have the primary drop its replicas' connections (``CLIENT KILL TYPE replica``).

        With the replicas paused first, nothing the primary writes from now on
        reaches them: they cannot reconnect until resumed. Pausing alone is not
        a stalled link on loopback: the kernel takes the primary's writes into
        the paused replica's socket buffers, and the replica reads them all
        once resumed, even after the primary died.
        """
        with self._client(self.primary_port) as primary:
            _command(primary, "CLIENT", "KILL", "TYPE", "replica")

    def resume_replicas(self) -> None:
        """SIGCONT the replicas :meth:`pause_replicas` stopped."""
        while self._paused:
            process = self._paused.pop()
            if process.running:
                os.kill(process.pid, signal.SIGCONT)

    def wait_for_new_primary(self, old: int, timeout: float = FAILOVER_WAIT) -> int:
        """Wait until every Sentinel has switched from ``old`` to a primary that says so; its port.

        Switched: ``SENTINEL MASTER`` names another address with no down flag
        (redis-py's ``Sentinel`` only takes a primary a Sentinel reports so),
        and that server's ``ROLE`` is master.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self._switched(old)
            if found is not None:
                self.primary_port = found
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Sentinels did not switch from {old} within {timeout} s: {self.describe()}"
                )
            time.sleep(0.02)

    def _switched(self, old: int) -> int | None:
        ports = set()
        for sentinel in self.sentinels:
            try:
                with self._client(sentinel.port) as client:
                    state = _master(client)
            except ERRORS:
                return None
            if _flags(state) != {"master"}:
                return None
            ports.add(int(state["port"]))
        if len(ports) != 1 or old in ports:
            return None
        port = ports.pop()
        try:
            with self._client(port) as client:
                role = _command(client, "ROLE")
        except ERRORS:
            return None
        name = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
        return port if name == "master" else None

    def restart_killed_as_replica(self) -> None:
        """Start the killed server again on its port, empty, as a replica of the primary."""
        if self.killed is None:
            raise RuntimeError("no server was killed")
        process, self.killed = self.killed, None
        self._start_data(process, self.primary_port)

    # --- readiness ------------------------------------------------------------------------

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until a failover can happen: both replicas have the primary's writes, and
        every Sentinel knows the two others and two healthy replicas of the primary."""
        deadline = time.monotonic() + timeout
        problem = ""
        while time.monotonic() < deadline:
            problem = self._not_ready()
            if not problem:
                return
            time.sleep(0.05)
        raise TimeoutError(f"not ready within {timeout} s: {problem}; {self.describe()}")

    def _not_ready(self) -> str:
        try:
            with self._client(self.primary_port) as primary:
                primary.set(PROBE_KEY, "1")
                # WAIT counts replicas that acknowledged the write: both are streaming.
                acknowledged = int(primary.wait(2, 100))
                if acknowledged < 2:
                    return f"{acknowledged} of 2 replicas acknowledge the primary's writes"
                primary.delete(PROBE_KEY)
            for sentinel in self.sentinels:
                with self._client(sentinel.port) as client:
                    state = _master(client)
                    if _flags(state) != {"master"} or int(state["port"]) != self.primary_port:
                        return f"Sentinel {sentinel.port} sees {state['port']} {state['flags']}"
                    others = int(state["num-other-sentinels"])
                    if others < 2:
                        return f"Sentinel {sentinel.port} knows {others} other Sentinels"
                    healthy = [
                        r
                        for r in _replicas(client)
                        if _flags(r) == {"slave"}
                        and int(r.get("master-port", 0)) == self.primary_port
                    ]
                    if len(healthy) < 2:
                        return f"Sentinel {sentinel.port} sees {len(healthy)} healthy replicas"
        except ERRORS as error:
            return f"{type(error).__name__}: {error}"
        return ""

    def describe(self) -> str:
        """What each Sentinel says of the primary, on one line (for errors)."""
        parts = []
        for sentinel in self.sentinels:
            try:
                with self._client(sentinel.port) as client:
                    state = _master(client)
                parts.append(f"{sentinel.port}: {state['port']} {state['flags']}")
            except ERRORS as error:
                parts.append(f"{sentinel.port}: {type(error).__name__}")
        return "; ".join(parts)
