"""The README's Python examples run and do what the text around them says."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from pathlib import Path
from typing import Any

import mongomock
import pytest
import redis

import dmutex
from tests._support.mongo_clients import AsyncMongomockClient, frozen_ttl_monitor

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
RUNNABLE = [block for block in BLOCKS if "not run by tests/test_readme.py" not in block]
REDIS = [block for block in RUNNABLE if "import redis" in block]
LOCAL = [block for block in RUNNABLE if block not in REDIS]


def run(block: str, namespace: dict[str, Any]) -> None:
    code = compile(block, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if inspect.iscoroutine(result):
        asyncio.run(result)


def test_the_readme_has_examples() -> None:
    assert len(LOCAL) >= 7
    assert len(REDIS) >= 2


def test_every_example_says_what_it_needs() -> None:
    """An example that needs a server says so in a comment on its import line."""
    for block in BLOCKS:
        for line in block.splitlines():
            if line.startswith(("import redis", "import pymongo")):
                assert "# needs a " in line, line


@pytest.mark.parametrize("block", LOCAL, ids=[b.splitlines()[0] for b in LOCAL])
def test_example_runs(block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each example runs as pasted: it defines everything it uses."""
    namespace: dict[str, Any] = {}
    if "mongomock" in block or "import pymongo" in block:
        # mongomock's own TTL imitation calls datetime.utcnow(), deprecated
        # since Python 3.12; hold it still, as the other mongomock tests do.
        monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
    if "import pymongo" in block:
        # No MongoDB server here: the examples run against mongomock instead
        # (behind an awaiting wrapper for the asyncio one).
        sync, asynchronous = (
            'pymongo.MongoClient("mongodb://localhost:27017")',
            'pymongo.AsyncMongoClient("mongodb://localhost:27017")',
        )
        assert sync in block or asynchronous in block
        block = block.replace(sync, "mongomock.MongoClient()")
        block = block.replace(asynchronous, "AsyncMongomockClient(mongomock.MongoClient())")
        block = block.replace("await client.close()", "client.inner.close()")
        namespace.update(mongomock=mongomock, AsyncMongomockClient=AsyncMongomockClient)
    run(block, namespace)


@pytest.mark.parametrize("block", REDIS, ids=[b.splitlines()[0] for b in REDIS])
def test_redis_example_runs(block: str, redis_url: str) -> None:
    """The Redis examples, pointed at a test server instead of localhost:6379."""
    assert "redis://localhost:6379" in block
    run(block.replace("redis://localhost:6379", redis_url), {})
    with redis.Redis.from_url(redis_url) as server:
        assert server.keys("*permit:*") == [], "an example left a lock behind"


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = README[README.index("## API reference") :]
    missing = [name for name in dmutex.__all__ if f"`{name}" not in reference]
    assert missing == []
