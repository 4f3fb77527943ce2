"""Servers the fault tests kill with SIGKILL and start again on the same port, data kept.

:class:`DurableRedis` runs a ``redis-server`` from ``redis_servers`` (7.0 where
there is one) on a free loopback port with ``appendonly yes`` and
``appendfsync always`` in a folder of its own, so that every write the server
acknowledged is on disk before the reply leaves: a lease acknowledged before
a kill is still there after the restart.

:class:`DurableSecantusDB` runs SecantusDB (a MongoDB-compatible server, not
MongoDB) on a folder of its own with ``sync_on_commit=True``. Its default
does not survive a SIGKILL: with ``transaction_sync`` off, every write since
its last checkpoint (60 s apart by default) was gone after a restart when
tried here (19 documents written and acknowledged, 0 after the restart);
with ``sync_on_commit=True`` all of them were there. ``secantus_daemon.py``
does not expose that option, so this module starts SecantusDB with a launcher
of its own (:data:`SECANTUS_LAUNCHER`, run with ``python -I -c``).

Both are stopped by pid: :meth:`kill` sends SIGKILL and waits for the
process; :meth:`close` stops a running one (SIGTERM, then SIGKILL) and
removes the folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import pymongo.errors

from tests._support import mongo_servers, redis_servers
from tests._support.processes import stop_process

WANTED_REDIS = "7.0"
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

    def __init__(self) -> None:
        self.port = redis_servers.free_port()
        self._dir: tempfile.TemporaryDirectory[str] | None = tempfile.TemporaryDirectory(
            prefix=f"dmutex-fault-{self.name}-"
        )
        self.folder = Path(self._dir.name)
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def wait_until_up(self, process: subprocess.Popen[bytes]) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not running"
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (again) on the same port and folder; return once it answers."""
        assert self._proc is None, "already running"
        with open(self.folder / f"{self.name}.log", "ab") as log:
            self._proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env()
            )
        self.starts += 1
        try:
            self.wait_until_up(self._proc)
        except BaseException:
            stop_process(self._proc)
            self._proc = None
            raise

    def kill(self) -> None:
        """SIGKILL the server by its pid and wait until it is gone."""
        assert self._proc is not None, "not running"
        os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=10)
        self._proc = None

    def log_tail(self, lines: int = 5) -> str:
        path = self.folder / f"{self.name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def close(self) -> None:
        """Stop the server if it runs (by pid) and remove its folder."""
        if self._proc is not None:
            stop_process(self._proc, timeout=20)
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

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
        return [
            str(self.executable.path),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--daemonize", "no",
            "--dir", str(self.folder),
            *self.persistence,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return redis_servers._library_env()

    def wait_until_up(self, process: subprocess.Popen[bytes]) -> None:
        # Pings until it answers, through LOADING while it replays its file.
        redis_servers.wait_until_up("127.0.0.1", self.port)


# Run with ``python -I -c``: no script folder and no PYTHON* variables on the
# path, as secantus_daemon.py is. argv: port, storage folder (or ":memory:").
SECANTUS_LAUNCHER = """\
import signal, sys, threading
from secantus import SecantusDBServer

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
server = SecantusDBServer(
    host="127.0.0.1",
    port=int(sys.argv[1]),
    storage_path=sys.argv[2],
    replica_set_name=None,
    enable_test_commands=False,
    sync_on_commit=True,
)
server.start()
try:
    while not stop.wait(0.5):
        pass
finally:
    server.stop()
"""


class DurableSecantusDB(_Restartable):
    """SecantusDB on disk, each commit synced before it is acknowledged; or in memory."""

    name = "secantusdb"

    def __init__(self, *, in_memory: bool = False) -> None:
        self.in_memory = in_memory  # nothing kept across a restart, as a test server often is
        super().__init__()

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/?directConnection=true"

    def command(self) -> list[str]:
        data = self.folder / "data"
        storage = ":memory:" if self.in_memory else str(data)
        return [sys.executable, "-I", "-c", SECANTUS_LAUNCHER, str(self.port), storage]

    def env(self) -> dict[str, str]:
        # Whatever temporary files it makes go into its own folder.
        return {**os.environ, "TMPDIR": str(self.folder)}

    def wait_until_up(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + mongo_servers.START_TIMEOUT
        while True:
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"SecantusDB exited with code {code}: {self.log_tail()}")
            try:
                mongo_servers.wait_until_up(self.url, timeout=0)
                return
            except pymongo.errors.ConnectionFailure:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
