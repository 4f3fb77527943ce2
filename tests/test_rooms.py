"""A backend is one room: ``src/dmutex/_backends/<name>/``, and nothing else depends on it.

The rules, read from every module's imports and identifiers:

1. A backend's package (a *room*) is imported, outside itself, only by the
   registry (``_backends/__init__.py``), the hub of published client
   protocols (``_backends/clients.py``) and ``dmutex/__init__.py`` (the
   public names). A room imports no other room but ``sql/``, which holds
   what the SQL rooms share.
2. No module outside a room has an identifier (a name, an attribute, a
   definition, an import) that names a backend; messages and docs may.
3. Every room has a ``descriptor.py`` whose ``BACKEND`` the registry lists;
   a room the command can reach has a ``url.py`` whose ``FORM`` its
   descriptor carries, and no two forms share a scheme.
4. ``backend=``'s public type names the backends ``backend=`` can choose.
"""

from __future__ import annotations

import ast
import importlib
import re
from typing import get_args

from dmutex._backends import BACKENDS, URL_FORMS
from dmutex._validate import BackendName
from tests.test_layers import SRC, all_imports, modules, where

ROOMS = ("memory", "sqlite", "redis", "mongodb", "postgresql", "mysql", "etcd", "dynamodb")
SHARED = "sql"
MAY_IMPORT_ROOMS = {"dmutex", "dmutex._backends", "dmutex._backends.clients"}
# What a backend's name looks like in an identifier.
NAMES = re.compile(
    r"mysql|mariadb|asyncmy|postgres|psycopg|asyncpg|mongo|motor|redis|valkey|sqlite|inmemory"
    r"|dynamo|boto",
    re.IGNORECASE,
)


def room_of(module: str) -> str | None:
    """The room (or ``sql``) that module ``module`` belongs to, or None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["dmutex", "_backends"] and parts[2] in (*ROOMS, SHARED):
        return parts[2]
    return None


def identifiers(source: str) -> list[tuple[int, str]]:
    """Every identifier of ``source`` with its line: names, attributes, definitions, imports."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.alias):
            found.extend((node.lineno, part) for part in (node.name, node.asname or ""))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_identifier_scan_sees_each_kind_and_skips_text() -> None:
    """The check can fail: it finds a backend in each kind of identifier, never in a string."""
    source = """
from .redis import shapes as redis_shapes
import psycopg
def is_mongo(client, sqlite_path): return client.asyncpg_pool
class MySQLThing: pass
MESSAGE = "on PostgreSQL, MySQL or Redis"
"""
    named = sorted({text for _, text in identifiers(source) if NAMES.search(text)})
    assert named == [
        "MySQLThing",
        "asyncpg_pool",
        "is_mongo",
        "psycopg",
        "redis",
        "redis_shapes",
        "sqlite_path",
    ]


def test_only_the_registry_the_hub_and_the_package_import_a_room() -> None:
    reaching = []
    for name, imported in all_imports().items():
        own = room_of(name)
        for item in imported:
            room = room_of(item.target)
            if room is None or room == own:
                continue
            if own is not None and room == SHARED:
                continue
            if own is None and name in MAY_IMPORT_ROOMS:
                continue
            reaching.append(f"{where(name, item)}: {name} imports {item.target}")
    assert not reaching, "imports of a backend's room from outside it:\n" + "\n".join(reaching)


def test_no_identifier_outside_the_rooms_names_a_backend() -> None:
    named = []
    for name, path in modules().items():
        if room_of(name) is not None or name in MAY_IMPORT_ROOMS:
            continue
        for line, text in identifiers(path.read_text()):
            if NAMES.search(text):
                named.append(f"{path.relative_to(SRC.parent)}:{line}: {text}")
    assert not named, "identifiers that name a backend outside its room:\n" + "\n".join(named)


def test_every_room_describes_itself_once() -> None:
    listed = {backend.name: backend for backend in BACKENDS}
    assert len(listed) == len(BACKENDS) == len(ROOMS)
    for room in ROOMS:
        folder = SRC / "dmutex" / "_backends" / room
        assert (folder / "descriptor.py").is_file(), room
        descriptor = importlib.import_module(f"dmutex._backends.{room}.descriptor").BACKEND
        assert listed[descriptor.name] is descriptor, room
        has_url = (folder / "url.py").is_file()
        assert (descriptor.url is not None) == has_url, room
        if has_url:
            form = importlib.import_module(f"dmutex._backends.{room}.url").FORM
            assert descriptor.url is form, room
    schemes = [scheme for form in URL_FORMS for scheme in form.schemes]
    assert len(schemes) == len(set(schemes)), schemes
    assert sum(form.default is not None for form in URL_FORMS) == 1


def test_backend_names_the_backends_it_can_choose() -> None:
    choosable = {backend.name for backend in BACKENDS if backend.instance is None}
    assert set(get_args(BackendName)) == choosable
