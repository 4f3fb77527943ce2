"""The README's Python examples run and do what the text around them says."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import dmutex
from dmutex import BackendUnavailableError, InMemoryBackend

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
RUNNABLE = [block for block in BLOCKS if "DMutex(service_name," not in block]


def test_the_readme_has_examples() -> None:
    assert len(RUNNABLE) >= 6


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.splitlines()[0] for b in RUNNABLE])
def test_example_runs(block: str) -> None:
    namespace: dict[str, Any] = {"client": InMemoryBackend(), "async_client": InMemoryBackend()}
    code = compile(block, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    server = "import redis" in block or "import pymongo" in block
    try:
        if server:
            with pytest.raises(BackendUnavailableError):
                eval(code, namespace)
            return
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            asyncio.run(result)
    finally:
        closing = getattr(namespace["client"], "close", None)
        if server and closing is not None and not inspect.iscoroutinefunction(closing):
            closing()


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = README[README.index("## API reference") :]
    missing = [name for name in dmutex.__all__ if f"`{name}" not in reference]
    assert missing == []
