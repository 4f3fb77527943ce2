# The part of mockupdb 1.8 that tests/integration/test_mongo_wire.py uses;
# mockupdb ships no annotations. Its go() is left out on purpose: its future
# re-raises type(error)(str(error)), which drops pymongo's code and details.
from collections.abc import Mapping
from typing import Any

class Request:
    # The command document as decoded on the mock server (dates: naive UTC).
    @property
    def doc(self) -> dict[str, Any]: ...
    # The database name.
    @property
    def namespace(self) -> str | None: ...
    # Defined on commands (OpMsg, Command); a pymongo 4 client sends only OP_MSG.
    @property
    def command_name(self) -> str | None: ...
    def ok(self, *args: Any, **kwargs: Any) -> bool: ...
    def hangup(self) -> bool: ...

class MockupDB:
    def __init__(
        self,
        port: int | None = None,
        verbose: bool = False,
        request_timeout: float = 10,
        auto_ismaster: bool | Mapping[str, Any] | None = None,
        ssl: bool = False,
        min_wire_version: int = 0,
        max_wire_version: int = 6,
        uds_path: str | None = None,
    ) -> None: ...
    def run(self) -> int: ...
    def stop(self) -> None: ...
    # Returns None only once the server is stopped.
    def receives(self, *args: Any, timeout: float = ..., **kwargs: Any) -> Request: ...
    def got(self, *args: Any, timeout: float = ..., **kwargs: Any) -> bool: ...
    @property
    def uri(self) -> str: ...
