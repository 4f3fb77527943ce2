"""Servers the fault tests kill with SIGKILL and start again on the same port, data kept.

:class:`DurableRedis` runs a ``redis-server`` from ``redis_servers`` (7.0 where
there is one) on a free loopback port with ``appendonly yes`` and
``appendfsync always`` in a folder of its own, so that every write the server
acknowledged is on disk before the reply leaves: a lease acknowledged before
a kill is still there after the restart.

:class:`DurableSecantusDB` runs SecantusDB (a MongoDB-compatible server, not
MongoDB) on a folder of its own with ``sync_on_commit=True`` (the launcher's
``--sync-on-commit``, ``secantus_daemon.py``). Its default does not survive
a SIGKILL: with ``transaction_sync`` off, every write since its last
checkpoint (60 s apart by default) was gone after a restart when tried here
(19 documents written and acknowledged, 0 after the restart); with
``sync_on_commit=True`` all of them were there.

For :class:`RestartablePostgres` see its docstring: ``synchronous_commit``
on, ``fsync`` off, which a process kill does not undo.

Each is a :class:`~tests._support.servers.ServerProcess` that keeps its port
and folder across restarts, stopped by pid: :meth:`kill` sends SIGKILL and
waits for the process; :meth:`close` stops a running one (SIGTERM, then
SIGKILL) and removes the folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from tests._support import mongo_servers, postgres_servers, redis_servers, servers

WANTED_REDIS = "7.0"
KILL_TIMEOUT = 10.0  # seconds for a SIGKILLed process to be gone
_R = TypeVar("_R", bound="_Restartable")


def redis_executable() -> redis_servers.Executable | None:
    """The ``redis-server`` to kill and restart: 7.0 if there is one, else the newest."""
    found = redis_servers.executables()
    for executable in found:
        if executable.label == f"redis-{WANTED_REDIS}":
            return executable
    return found[-1] if found else None


class _Restartable:
    """A server process on a fixed port and folder that can be killed and started again."""

    name = "server"
    start_timeout = servers.START_TIMEOUT

    def __init__(self) -> None:
        self._process = servers.ServerProcess(f"fault-{self.name}", keep=True)
        self.port = self._process.port
        self.folder = self._process.folder
        self.starts = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def answer(self) -> None:
        """Ask the server once; raises one of ``retry`` until it answers."""
        raise NotImplementedError

    retry: tuple[type[BaseException], ...] = ()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.running

    def start(self) -> None:
        """Start the server (again) on the same port and folder; return once it answers."""
        self.starts += 1
        self._process.start(
            lambda folder, port: self.command(),
            lambda port: self.answer(),
            self.retry,
            env=lambda folder: self.env(),
            what=self.name,
            timeout=self.start_timeout,
        )

    def kill(self) -> None:
        """SIGKILL the server by its pid and wait until it is gone."""
        self._process.kill()

    def log_tail(self, lines: int = 5) -> str:
        return self._process.log_tail(lines)

    def close(self) -> None:
        """Stop the server if it runs (by pid) and remove its folder."""
        self._process.close()

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


# How a restarted Redis keeps its data: every write (the fault tests), nothing
# (a cache), or the snapshots of the usual ``save`` setting, which a SIGKILL
# rolls back to the last one (SAVE or BGSAVE by hand here: no timer fires).
REDIS_PERSISTENCE = {
    "aof-always": ["--save", "", "--appendonly", "yes", "--appendfsync", "always"],
    "none": ["--save", "", "--appendonly", "no"],
    "rdb": ["--save", "3600 1", "--appendonly", "no"],
}


class DurableRedis(_Restartable):
    """``redis-server`` with an append-only file synced on every write (or as ``persistence``)."""

    name = "redis"
    # Through LOADING, while it replays its file.
    retry = redis_servers.PING_ERRORS

    def __init__(
        self, executable: redis_servers.Executable, persistence: str = "aof-always"
    ) -> None:
        self.executable = executable
        self.persistence = REDIS_PERSISTENCE[persistence]
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return redis_servers.command(
            self.executable.path, self.port, self.folder, *self.persistence
        )

    def env(self) -> dict[str, str]:
        return redis_servers._library_env()

    def answer(self) -> None:
        redis_servers.version_of(servers.LOOPBACK, self.port)


class DurableSecantusDB(_Restartable):
    """SecantusDB on disk, each commit synced before it is acknowledged; or in memory."""

    name = "secantusdb"
    retry = mongo_servers.PING_ERRORS
    start_timeout = mongo_servers.START_TIMEOUT

    def __init__(self, *, in_memory: bool = False) -> None:
        self.in_memory = in_memory  # nothing kept across a restart, as a test server often is
        super().__init__()

    @property
    def url(self) -> str:
        return mongo_servers.loopback_url(self.port)

    def command(self) -> list[str]:
        data = Path(self.folder) / "data"
        storage = ":memory:" if self.in_memory else str(data)
        return mongo_servers.secantus_command(
            sys.executable, self.port, storage_path=storage, sync_on_commit=True
        )

    def env(self) -> dict[str, str]:
        # Whatever temporary files it makes go into its own folder.
        return {**os.environ, "TMPDIR": str(self.folder)}

    def answer(self) -> None:
        mongo_servers.wait_until_up(self.url, timeout=0)


class RestartablePostgres(_Restartable):
    """A PostgreSQL cluster of its own (``initdb`` once), killed and started again on its folder.

    The server runs as the harness's executable server does
    (``postgres_servers.server_command``: as the unprivileged user when run
    as root, superuser ``dmutex``, trust), but with ``synchronous_commit``
    on: a commit is acknowledged once its WAL is written to the kernel.
    ``fsync`` stays off, so nothing is flushed to the disk; a SIGKILL kills
    processes, not the page cache, so every acknowledged commit is there
    after the restart's crash recovery. (With the harness's
    ``synchronous_commit=off`` the WAL of the last few hundred milliseconds
    lives in shared memory only, and a kill loses it.) A crash of the
    machine would lose it: the cluster is thrown away at the end.

    :meth:`kill` SIGKILLs the postmaster by its pid (``postmaster.pid``),
    then every process left of the server (its backends) by the process
    group the harness started, or by the postmaster's children.
    """

    name = "postgres"
    retry = postgres_servers.PING_ERRORS
    start_timeout = postgres_servers.START_TIMEOUT

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self._process = servers.ServerProcess(
            "fault-postgres",
            user=postgres_servers.unprivileged_user(),
            keep=True,
            stop_signal=signal.SIGINT,
        )
        self.port = self._process.port
        self.folder = self._process.folder
        self.starts = 0
        self.postmaster: int | None = None

    @property
    def url(self) -> str:
        return postgres_servers.url_of(
            servers.LOOPBACK, self.port, postgres_servers.SUPERUSER, postgres_servers.DATABASE
        )

    def command(self) -> list[str]:
        return postgres_servers.server_command(
            self.bindir, self.folder, self.port, synchronous_commit=True
        )

    def answer(self) -> None:
        postgres_servers.server_version(self.url)

    def start(self) -> None:
        postgres_servers.make_cluster(self.bindir, self.folder, self._process.user)
        super().start()
        self.postmaster = postgres_servers.postmaster_pid(self.folder)

    def _children(self, pid: int) -> list[int]:
        path = Path(f"/proc/{pid}/task/{pid}/children")
        with contextlib.suppress(OSError):
            return [int(child) for child in path.read_text().split()]
        return []

    def kill(self) -> None:
        """SIGKILL the postmaster by its pid, then its backends; wait until all are gone.

        Under ``runuser`` the postmaster is left to its parent to reap before
        ``runuser`` itself is killed: a postmaster orphaned by the kill stays a
        zombie where the container's init reaps nothing, and a new postmaster
        takes the zombie's pid in ``postmaster.pid`` for a running server.
        """
        postmaster = self.postmaster
        if postmaster is None:
            raise RuntimeError("postgres is not running")
        backends = self._children(postmaster)
        with contextlib.suppress(ProcessLookupError):
            os.kill(postmaster, signal.SIGKILL)
        for pid in backends:  # not root: no process group of the server's own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.postmaster = None
        if self._process.user is not None:  # runuser's child: reaped by runuser, then gone
            deadline = time.monotonic() + KILL_TIMEOUT
            while Path(f"/proc/{postmaster}").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postmaster {postmaster} still there after SIGKILL")
                time.sleep(0.01)
        self._process.kill()  # the group (runuser, any backend left), and the wait
