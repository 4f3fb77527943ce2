# The part of SecantusDB 0.7.0b3 that tests/_support/secantus_daemon.py uses;
# the package ships no py.typed marker.

__version__: str

class SecantusDBServer:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        storage_path: str = "./secantus-data",
        *,
        replica_set_name: str | None = "secantus",
        enable_test_commands: bool = True,
        ttl_sweep_seconds: float = 60.0,
        sync_on_commit: bool = False,
    ) -> None: ...
    @property
    def uri(self) -> str: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
