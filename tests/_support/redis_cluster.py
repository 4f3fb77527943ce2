"""A local three-master Redis Cluster started from a ``redis-server``, replicas optional.

Three processes on free 127.0.0.1 ports, persistence off, each a
:class:`~tests._support.servers.ServerProcess` with a folder of its own. The
16384 hash slots are split in three ranges with ``CLUSTER ADDSLOTS``
(``ADDSLOTSRANGE`` is Redis 7.0+ only), the nodes are introduced with
``CLUSTER MEET``, and :meth:`LocalCluster.start` returns once every node
reports ``cluster_state:ok`` and knows three masters. :meth:`LocalCluster.stop`
stops every process by its pid and removes the folders.

With ``replicas=N`` each master gets N more nodes that ``CLUSTER REPLICATE``
it, and ``start`` returns once a write to each master reaches its replicas
(``WAIT``); :attr:`LocalCluster.replica_ports` maps each master's port to
its replicas', and :meth:`LocalCluster.process` gives a node's process, to
pause it by its pid.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import redis
import redis.cluster

from dmutex._backends.redis.cluster import hash_slot
from tests._support import redis_servers
from tests._support.servers import ServerProcess

START_TIMEOUT = 30.0
HASH_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # Redis 6.2 has no cluster-port option: the bus is port + 10000.
# Persistence off; the node's own cluster file follows, named by its port.
CLUSTER_ARGS = (
    "--save",
    "",
    "--appendonly",
    "no",
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port(taken: set[int]) -> int:
    """A free 127.0.0.1 port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        bus = port + BUS_PORT_OFFSET
        if (
            bus < 65536
            and not {port, bus} & taken
            and not {p + BUS_PORT_OFFSET for p in taken} & {port}
            and _bindable(bus)
        ):
            return port
    raise RuntimeError("found no free port pair (port, port + 10000) on 127.0.0.1")


def slot_ranges(nodes: int) -> list[range]:
    """The hash slots split into ``nodes`` contiguous ranges."""
    size, rest = divmod(HASH_SLOTS, nodes)
    ranges, start = [], 0
    for i in range(nodes):
        end = start + size + (1 if i < rest else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


class LocalCluster:
    """Three masters started from ``path``; ``start()`` gives their ``(host, port)``."""

    host = "127.0.0.1"

    def __init__(self, path: Path | str, nodes: int = 3, replicas: int = 0) -> None:
        self.path = Path(path)
        self.nodes = nodes
        self.replicas = replicas  # per master
        self.ports: list[int] = []
        self.replica_ports: dict[int, list[int]] = {}  # master's port: its replicas' ports
        self.version = ""
        self._nodes: list[ServerProcess] = []

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> list[tuple[str, int]]:
        """Start the nodes, build the cluster, wait until it serves every slot."""
        try:
            self._spawn()
            self._assign_slots()
            self._meet()
            self._wait_until_ok()
            if self.replicas:
                self._add_replicas()
        except BaseException:
            self.stop()
            raise
        return [(self.host, port) for port in self.ports]

    def stop(self) -> None:
        """Stop every process by its pid and remove the folders."""
        for node in self._nodes:
            node.stop()
        self._nodes = []
        self.ports = []
        self.replica_ports = {}

    def process(self, port: int) -> ServerProcess:
        """The node on ``port``: to pause or kill it by its pid."""
        return next(node for node in self._nodes if node.port == port)

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self._nodes]

    # --- steps --------------------------------------------------------------------

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(host=self.host, port=port, socket_timeout=5, decode_responses=True)

    def _spawn(self) -> None:
        taken: set[int] = set()
        for _ in range(self.nodes):
            self.ports.append(self._start_node(taken))

    def _start_node(self, taken: set[int]) -> int:
        """Start one more node on a free port pair; its port."""
        port = free_cluster_port(taken)
        taken.add(port)
        node = ServerProcess("redis-cluster", port=port, stop_timeout=10)
        self._nodes.append(node)
        self.version = redis_servers.start_redis(
            node,
            lambda folder, port: redis_servers.command(
                self.path, port, folder, *CLUSTER_ARGS, f"nodes-{port}.conf"
            ),
            what=f"{self.path} on port {port}",
        )
        return port

    def _add_replicas(self) -> None:
        """Start ``replicas`` nodes per master, make each replicate it, wait until they ack."""
        taken = set(self.ports)
        for master in self.ports:
            with self._client(master) as r:
                master_id = str(r.execute_command("CLUSTER", "MYID"))
            for _ in range(self.replicas):
                port = self._start_node(taken)
                self.replica_ports.setdefault(master, []).append(port)
                with self._client(port) as r:
                    r.execute_command("CLUSTER", "MEET", self.host, master)
                    self._until(partial(self._knows, port, master_id), f"node {port} to meet")
                    r.execute_command("CLUSTER", "REPLICATE", master_id)
        for master, slots in zip(self.ports, slot_ranges(self.nodes), strict=True):
            probe = next(f"probe{{{n}}}" for n in range(100_000) if hash_slot(f"{n}") in slots)
            self._until(partial(self._acknowledged, master, probe), f"{master}'s replicas")
        self._wait_until_ok()

    def _knows(self, port: int, node_id: str) -> bool:
        with self._client(port) as r:
            return node_id in str(r.execute_command("CLUSTER", "NODES"))

    def _acknowledged(self, master: int, probe: str) -> bool:
        """Whether a write to ``master`` reached its replicas: after a diskless
        sync, the link streams only from a replica's first acknowledgement on."""
        with self._client(master) as r:
            r.execute_command("SET", probe, "1")
            return int(r.execute_command("WAIT", self.replicas, 100)) >= self.replicas

    def _until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting for {what} after {START_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def _assign_slots(self) -> None:
        for port, slots in zip(self.ports, slot_ranges(self.nodes), strict=True):
            with self._client(port) as r:
                r.execute_command("CLUSTER", "ADDSLOTS", *slots)

    def _meet(self) -> None:
        with self._client(self.ports[0]) as r:
            for port in self.ports[1:]:
                r.execute_command("CLUSTER", "MEET", self.host, port)

    def _node_ok(self, port: int) -> bool:
        with self._client(port) as r:
            info = str(r.execute_command("CLUSTER", "INFO"))
            nodes = str(r.execute_command("CLUSTER", "NODES"))
        fields = dict(
            line.split(":", 1) for line in info.splitlines() if ":" in line and line.strip()
        )
        masters = [
            line
            for line in nodes.splitlines()
            if line.strip() and "master" in line.split()[2].split(",")
        ]
        settled = all(
            not {"handshake", "fail", "fail?", "noaddr"} & set(line.split()[2].split(","))
            for line in masters
        )
        return (
            fields.get("cluster_state", "").strip() == "ok"
            and fields.get("cluster_slots_ok", "").strip() == str(HASH_SLOTS)
            and len(masters) == self.nodes
            and settled
        )

    def _wait_until_ok(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            for node in self._nodes:
                if not node.running:
                    raise RuntimeError(
                        f"cluster node on port {node.port} exited: {node.log_tail()}"
                    )
            if all(self._node_ok(port) for port in self.ports):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Redis Cluster on ports {self.ports} not ok after {START_TIMEOUT:.0f} s"
                )
            time.sleep(0.1)


class ClusterRecorded:
    """A cluster client that records each command as ``kind(args)``.

    ``keyslot`` on the type marks it a cluster client to dmutex's detection.
    """

    def __init__(
        self, inner: redis.cluster.RedisCluster, kind: Callable[[tuple[Any, ...]], str]
    ) -> None:
        self.inner = inner
        self._send: Callable[..., Any] = inner.execute_command
        self._kind = kind
        self.kinds: list[str] = []

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self.kinds.append(self._kind(args))
        return self._send(*args, **kwargs)

    def keyslot(self, key: str) -> int:
        slot: int = cast(Any, self.inner).keyslot(key)
        return slot

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
