"""Run one SecantusDB server in this process until SIGTERM or SIGINT (test use only).

``python -I secantus_daemon.py --port N [--ttl-sweep-seconds S]
[--storage-path PATH] [--sync-on-commit]``. ``tests/_support/mongo_servers.py``
(the session's server) and ``tests/_support/fault_servers.py`` (the one the
fault tests kill and restart, on disk with ``--sync-on-commit``) start it as a
subprocess (isolated mode: no script folder, no ``PYTHON*`` variables on its
path) and stop it by its pid, so a server that hangs cannot wedge pytest.

SecantusDB's own ``secantusd-py`` is not used: it reads ``secantusd.toml``
from the working directory, the home directory and ``/etc`` unless told
otherwise, and it does not pass the ``ttl_sweep_seconds`` of that file on to
the server (0.7.0b3), so its TTL monitor always sleeps 60 s. This launcher
reads no configuration, listens on 127.0.0.1 only, and sets the sweep.

The server is started without the replica-set advertisement (``standalone``),
like the ``mongod`` the tests start: advertised as a replica set, pymongo
sends retryable writes, and SecantusDB 0.7.0b3 keeps a record of each and
scans all of them on every write, so that each write gets slower as the run
goes on (about 1 ms at first, 15 ms after 20,000 writes, measured here).
"""

from __future__ import annotations

import argparse
import signal
import threading
from types import FrameType

from secantus import SecantusDBServer

HOST = "127.0.0.1"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="secantus_daemon", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    # WiredTiger in memory; SecantusDB still makes an empty directory, under TMPDIR.
    parser.add_argument("--storage-path", default=":memory:")
    parser.add_argument("--ttl-sweep-seconds", type=float, default=60.0)
    # Each commit synced before it is acknowledged: what a SIGKILL must not lose.
    parser.add_argument("--sync-on-commit", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = SecantusDBServer(
        host=HOST,
        port=args.port,
        storage_path=args.storage_path,
        replica_set_name=None,
        enable_test_commands=False,
        ttl_sweep_seconds=args.ttl_sweep_seconds,
        sync_on_commit=args.sync_on_commit,
    )
    server.start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
