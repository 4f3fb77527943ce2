"""A Redis primary with replicas on loopback, for the tests of ``replicas=``.

:class:`Replicated` starts one ``redis-server`` as the primary and ``count``
more with ``--replicaof`` it, each a :class:`~tests._support.servers.ServerProcess`
on a free 127.0.0.1 port with persistence off, and returns once the primary
reports every replica online. The initial sync is diskless with no delay,
so a replica is online within milliseconds of its start.

A replica can be paused (SIGSTOP by pid) and resumed (SIGCONT): a stalled
replica, the fault ``WAIT`` exists for. The primary still accepts writes
meanwhile; none of them reaches the paused replica until it resumes.
:meth:`Replicated.stop` resumes and stops every process by its pid.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import redis

from tests._support import redis_servers, servers
from tests._support.servers import LOOPBACK

ONLINE_TIMEOUT = 20.0
# No RDB, no AOF; a diskless initial sync without the default 5 s delay.
ARGS = (
    *("--save", "", "--appendonly", "no"),
    *("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"),
)


class Replicated:
    """A primary and ``count`` replicas of ``executable``; :meth:`start` runs them."""

    def __init__(self, executable: Path, count: int = 1) -> None:
        self.executable = executable
        self.primary = servers.ServerProcess("redis-primary", stop_timeout=10)
        self.replicas = [
            servers.ServerProcess(f"redis-replica-{i}", stop_timeout=10) for i in range(count)
        ]
        self._paused: set[int] = set()

    def start(self) -> None:
        """Start the primary, then the replicas; return once every replica is online."""
        try:
            self._start(self.primary)
            for replica in self.replicas:
                self._start(replica, "--replicaof", LOOPBACK, str(self.primary.port))
            self.wait_online()
        except BaseException:
            self.stop()
            raise

    def _start(self, process: servers.ServerProcess, *extra: str) -> None:
        redis_servers.start_redis(
            process,
            lambda folder, port: redis_servers.command(
                self.executable, port, folder, *ARGS, *extra
            ),
        )

    def client(self, port: int | None = None) -> redis.Redis:
        """A redis-py client of the primary (or of the server on ``port``)."""
        return redis.Redis(LOOPBACK, port or self.primary.port, socket_timeout=10)

    def url(self) -> str:
        """The primary's URL."""
        return f"redis://{LOOPBACK}:{self.primary.port}/0"

    def wait_online(self, count: int | None = None) -> None:
        """Wait until ``count`` (default: all) replicas acknowledge a write of the primary.

        "online" in the primary's INFO is not enough: after a diskless sync
        the primary streams nothing to a replica until its first
        acknowledgement, which comes on the replica's next second-long tick.
        """
        wanted = len(self.replicas) if count is None else count
        deadline = time.monotonic() + ONLINE_TIMEOUT
        with self.client() as primary:
            while True:
                primary.set("dmutex-tests:probe", "1")
                acknowledged = int(primary.wait(wanted, 100))
                if acknowledged >= wanted:
                    primary.delete("dmutex-tests:probe")
                    return
                if time.monotonic() > deadline:
                    info = primary.info("replication")
                    raise TimeoutError(f"{acknowledged} of {wanted} replicas acknowledge: {info}")

    def pause(self, index: int = 0) -> None:
        """Stop replica ``index`` (SIGSTOP by pid): it acknowledges nothing until resumed."""
        os.kill(self.replicas[index].pid, signal.SIGSTOP)
        self._paused.add(index)

    def resume(self, index: int = 0) -> None:
        """Let replica ``index`` go on (SIGCONT): it catches up from the primary's backlog."""
        os.kill(self.replicas[index].pid, signal.SIGCONT)
        self._paused.discard(index)

    def stop(self) -> None:
        """Resume what is paused, then stop every process by its pid."""
        for index in sorted(self._paused):
            self.resume(index)
        for process in [*self.replicas, self.primary]:
            process.stop()
