"""The README and the documentation site say what the code does.

Every Python example of README.md and docs/ runs as written and does what the
text around it says; every public name has an entry in the API reference; the
files the pages name exist; the design page's module tree is the source tree;
the quick start's commands are the ones CI runs.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import logging
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import mongomock
import psycopg
import pytest
import redis
from psycopg import sql

import dmutex
from tests._support.dynamodb_servers import Session as DynamoSession
from tests._support.etcd_servers import Session as EtcdSession
from tests._support.etcd_servers import count_prefix
from tests._support.mongo_clients import AsyncMongomockClient, frozen_ttl_monitor
from tests._support.mysql_rows import NOW_MS, quoted
from tests._support.mysql_servers import Session as MySQLSession
from tests._support.mysql_servers import connect_args

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
TEXTS = {page: page.read_text() for page in PAGES}

# A Python example is a fence of its own, at the start of a line (not indented
# in a list or an admonition, where it could not run as pasted).
FENCE = re.compile(r"^```python\n(.*?)^```$", flags=re.DOTALL | re.MULTILINE)
NOT_RUN = "not run by tests/test_docs.py"


def _where(page: Path, text: str, block: str) -> str:
    line = text[: text.index(block)].count("\n") + 1
    return f"{page.relative_to(ROOT)}:{line}"


BLOCKS = [
    (_where(page, text, block), block)
    for page, text in TEXTS.items()
    for block in FENCE.findall(text)
]
RUNNABLE = [(where, block) for where, block in BLOCKS if NOT_RUN not in block]
REDIS = [(where, block) for where, block in RUNNABLE if "import redis" in block]
# A MySQL example says so on its import line (a SQLAlchemy one imports sqlalchemy too).
MYSQL = [(where, block) for where, block in RUNNABLE if "# needs a MySQL server" in block]
ETCD = [(where, block) for where, block in RUNNABLE if "# needs an etcd member" in block]
DYNAMODB = [(where, block) for where, block in RUNNABLE if "# needs a DynamoDB endpoint" in block]
POSTGRES = [
    (where, block)
    for where, block in RUNNABLE
    if ("import psycopg" in block or "import asyncpg" in block or "import sqlalchemy" in block)
    and (where, block) not in MYSQL
]
LOCAL = [
    (where, block)
    for where, block in RUNNABLE
    if (where, block) not in REDIS + POSTGRES + MYSQL + ETCD + DYNAMODB
]


def ids(blocks: list[tuple[str, str]]) -> list[str]:
    return [f"{where} {block.splitlines()[0]}" for where, block in blocks]


def run(where: str, block: str, namespace: dict[str, Any]) -> None:
    code = compile(block, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if inspect.iscoroutine(result):
        asyncio.run(result)


def test_the_docs_have_examples() -> None:
    """Every fence marked python is collected, and there are as many examples as were written."""
    for page, text in TEXTS.items():
        assert text.count("```python") == len(FENCE.findall(text)), page
    assert len(LOCAL) >= 11
    assert len(REDIS) >= 3
    assert len(POSTGRES) >= 2
    assert len(MYSQL) >= 4
    readme = [where for where, _ in RUNNABLE if where.startswith("README.md:")]
    assert len(readme) >= 2, "the README's taste of the API runs"


def test_every_example_says_what_it_needs() -> None:
    """An example that needs a server says so in a comment on its import line."""
    for where, block in BLOCKS:
        for line in block.splitlines():
            if line.startswith(
                (
                    "import redis",
                    "import pymongo",
                    "import psycopg",
                    "import asyncpg",
                    "import sqlalchemy",
                    "import pymysql",
                    "import aiomysql",
                    "import asyncmy",
                    "import MySQLdb",
                    "import mysql.connector",
                )
            ):
                assert "# needs a " in line, (where, line)


def test_an_example_not_run_here_names_the_test_that_runs_its_calls() -> None:
    skipped = [(where, block) for where, block in BLOCKS if NOT_RUN in block]
    assert skipped, "the Redis Cluster example is the one not run here"
    for where, block in skipped:
        named = re.findall(r"tests/[\w/]+\.py", block.replace(NOT_RUN, ""))
        assert named, where
        assert all((ROOT / path).is_file() for path in named), (where, named)


@pytest.mark.parametrize(("where", "block"), LOCAL, ids=ids(LOCAL))
def test_example_runs(where: str, block: str, monkeypatch: pytest.MonkeyPatch) -> None:
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
    # An example may configure logging, as an application does: undone after it.
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in DMUTEX_LOGGERS)]
    saved = [(logger, logger.level, list(logger.handlers)) for logger in loggers]
    try:
        run(where, block, namespace)
    finally:
        for logger, level, handlers in saved:
            logger.setLevel(level)
            logger.handlers[:] = handlers


DMUTEX_LOGGERS = ("dmutex", "dmutex.engine", "dmutex.renewal", "dmutex.observe")


@pytest.mark.parametrize(("where", "block"), REDIS, ids=ids(REDIS))
def test_redis_example_runs(where: str, block: str, redis_url: str) -> None:
    """The Redis examples, pointed at a test server instead of localhost:6379."""
    assert "redis://localhost:6379" in block
    run(where, block.replace("redis://localhost:6379", redis_url), {})
    with redis.Redis.from_url(redis_url) as server:
        assert server.keys("*permit:*") == [], "an example left a lock behind"


# The services an example names: its tables are ``_dmutex_<name>`` and ``_dsemaphore_<name>``.
SERVICE = re.compile(r"D(?:Mutex|Semaphore)\(\s*\"([^\"]+)\"")


@pytest.mark.parametrize(("where", "block"), POSTGRES, ids=ids(POSTGRES))
def test_postgresql_example_runs(
    where: str, block: str, postgres_server: str, postgres_schema: str
) -> None:
    """The PostgreSQL examples, on the test server, their tables in the run's schema.

    The schema is the session's, where other tests keep tables of their own
    (and may leave leases in them on purpose): the check reads only the tables
    of the services the example names, dropped before it runs.
    """
    here = re.compile(
        r"postgresql(\+\w+)?://localhost:5432/app"
    )  # a SQLAlchemy URL names its driver
    assert here.search(block)
    services = sorted(set(SERVICE.findall(block)))
    assert services, f"{where} names no service"
    tables = [f"{prefix}{name}" for name in services for prefix in ("_dmutex_", "_dsemaphore_")]
    joiner = "&" if "?" in postgres_server else "?"
    url = f"{postgres_server}{joiner}options=-csearch_path%3D{postgres_schema}"
    with psycopg.connect(url, autocommit=True) as conn:
        for table in tables:
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(postgres_schema, table))
            )
    run(
        where,
        here.sub(lambda found: url.replace("postgresql", found[0].split(":")[0], 1), block),
        {},
    )
    with psycopg.connect(url, autocommit=True) as conn:
        made = [
            table
            for (table,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename = ANY(%s)",
                (postgres_schema, tables),
            ).fetchall()
        ]
        assert made, "the example made its table in the run's schema"
        for table in made:
            held = conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM {} WHERE key LIKE 'permit:%%' "
                    "AND expired_at > statement_timestamp()"
                ).format(sql.Identifier(postgres_schema, table))
            ).fetchone()
            assert held == (0,), f"an example left a lock behind in {table}"


# How a MySQL example connects: keyword arguments (PyMySQL, aiomysql, asyncmy) or a
# SQLAlchemy URL, all at localhost:3306 as user "app", in database "app".
MYSQL_ARGS = re.compile(r'host="localhost",\s*port=3306,\s*user="app",\s*password="secret"')
MYSQL_DATABASE = re.compile(r'\b(database|db)="app"')
MYSQL_URL = re.compile(r"(mysql\+\w+)://app:secret@localhost:3306/app\b")


@pytest.mark.parametrize(("where", "block"), MYSQL, ids=ids(MYSQL))
def test_mysql_example_runs(where: str, block: str, mysql_session: MySQLSession) -> None:
    """The MySQL examples, on the test server, their tables in the session's database.

    Other tests keep tables of their own in that database: the check reads
    only the tables of the services the example names, dropped before it runs.
    """
    assert "mysql://localhost:3306/app" in block, "its import line says what it needs"
    server = mysql_session.server()
    args = connect_args(server.url)
    services = sorted(set(SERVICE.findall(block)))
    assert services, f"{where} names no service"
    tables = [f"{prefix}{name}" for name in services for prefix in ("_dmutex_", "_dsemaphore_")]
    given = (
        f"host={args['host']!r}, port={args['port']}, "
        f"user={args['user']!r}, password={args['password']!r}"
    )
    auth = quote(args["user"], safe="") + (
        f":{quote(args['password'], safe='')}" if args["password"] else ""
    )
    at = f"{auth}@{args['host']}:{args['port']}/{quote(server.database, safe='')}"
    code = "\n".join(line.partition("#")[0] for line in block.splitlines())
    places = len(MYSQL_ARGS.findall(code)) + len(MYSQL_URL.findall(code))
    assert places == code.count("localhost") > 0, f"{where}: a connection the test cannot point"
    pointed = MYSQL_ARGS.sub(lambda _: given, block)
    pointed = MYSQL_DATABASE.sub(lambda found: f"{found[1]}={server.database!r}", pointed)
    pointed = MYSQL_URL.sub(lambda found: f"{found[1]}://{at}", pointed)
    with server.connect() as conn, conn.cursor() as cursor:
        for table in tables:
            cursor.execute(f"DROP TABLE IF EXISTS {quoted(table)}")
    run(where, pointed, {})
    with server.connect() as conn, conn.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
        )
        made = [str(name) for (name,) in cursor.fetchall() if name in tables]
        assert made, "the example made its table in the session's database"
        for table in made:
            cursor.execute(
                f"SELECT count(*) FROM {quoted(table)} "
                f"WHERE `key` LIKE 'permit:%' AND `expired_at` > {NOW_MS}"
            )
            assert cursor.fetchone() == (0,), f"an example left a lock behind in {table}"


ETCD_ADDRESS = 'host="localhost", port=2379'


@pytest.mark.parametrize(("where", "block"), ETCD, ids=ids(ETCD))
def test_etcd_example_runs(where: str, block: str, etcd_session: EtcdSession) -> None:
    """The etcd examples, pointed at the test member instead of localhost:2379.

    They lock under their services' default prefixes (the member is the
    tests' own unless the user named one): each must leave no slot key there.
    """
    server = etcd_session.server()
    code = "\n".join(line.partition("#")[0] for line in block.splitlines())
    assert code.count(ETCD_ADDRESS) == code.count("localhost") > 0, f"{where}: cannot point it"
    run(where, block.replace(ETCD_ADDRESS, f"host={server.host!r}, port={server.port}"), {})
    endpoint = server.endpoints[0]
    for service in sorted(set(SERVICE.findall(block))):
        for prefix in ("_dmutex_", "_dsemaphore_"):
            left = count_prefix(endpoint, f"{prefix}{service}:permit:".encode())
            assert left == 0, f"an example left a lock behind under {prefix}{service}:"


DYNAMODB_ENDPOINT = '"http://localhost:8000"'
SERVICE_ANY = re.compile(r"D(?:Mutex|Semaphore|ReadWriteLock)\(\s*\"([^\"]+)\"")


@pytest.mark.parametrize(("where", "block"), DYNAMODB, ids=ids(DYNAMODB))
def test_dynamodb_example_runs(
    where: str, block: str, dynamodb_session: DynamoSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DynamoDB examples, pointed at moto's server (not DynamoDB) instead of localhost:8000.

    They lock in their services' default tables, which a server started
    here holds for this run alone (on a user's endpoint the test skips):
    each must leave no active slot item there; the tables are dropped after.
    """
    server = dynamodb_session.server("moto")
    if not server.local:
        pytest.skip("the examples' tables are outside the tests' prefix on the user's endpoint")
    code = "\n".join(line.partition("#")[0] for line in block.splitlines())
    assert code.count(DYNAMODB_ENDPOINT) == code.count("localhost") > 0, f"{where}: cannot point it"
    for name, value in server.credentials.items():
        monkeypatch.setenv(name.upper(), value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", server.region)
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    run(where, block.replace(DYNAMODB_ENDPOINT, repr(server.url)), {})
    services = sorted(set(SERVICE_ANY.findall(block)))
    assert services, f"{where}: no service to check"
    with server.connect() as client:
        for service in services:
            for prefix in ("_dmutex_", "_dsemaphore_", "_drwlock_"):
                table = f"{prefix}{service}"
                if table not in client.list_tables()["TableNames"]:
                    continue
                items = client.scan(TableName=table, ConsistentRead=True)["Items"]
                client.delete_table(TableName=table)
                now = int(time.time() * 1000)
                held = [i for i in items if int(i.get("expiredAt", {}).get("N", "0")) > now]
                assert [i for i in held if i["key"]["S"].startswith("permit:")] == [], (
                    f"an example left a lock behind in {table}"
                )


API = DOCS / "api.md"


def test_every_public_name_is_in_the_api_reference() -> None:
    """Each name of dmutex.__all__ has its generated entry; no entry names anything else."""
    entries = re.findall(r"^::: dmutex\.(\w+)$", API.read_text(), flags=re.MULTILINE)
    assert sorted(entries) == sorted(dmutex.__all__)


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len(README.read_text().splitlines()) < 250


def test_the_quick_start_commands_are_the_ones_ci_runs() -> None:
    """.ci/run runs the README's two commands as written, so the README says what CI checks."""
    readme = README.read_text()
    quick_start = readme[readme.index("## Quick start") :]
    commands = re.search(r"```sh\n(.*?)```", quick_start, flags=re.DOTALL)
    assert commands is not None
    lines = commands[1].splitlines()
    assert len(lines) == 2, lines
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in lines:
        assert line in ci, line


# A path in the repository, named in code: `examples/threads.py`, `tests/faults/`.
NAMED_PATH = re.compile(r"`((?:src|tests|examples|benchmarks|docs)/[\w./-]*)`")
# A relative Markdown link: [text](path) or [text](path#anchor).
LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")


def test_the_files_the_pages_name_exist() -> None:
    """Every repository path a page names in code, and every relative link of the README."""
    missing = [
        (str(page.relative_to(ROOT)), path)
        for page, text in TEXTS.items()
        for path in NAMED_PATH.findall(text)
        if not (ROOT / path).exists()
    ]
    readme = README.read_text()
    missing += [("README.md", path) for path in LINK.findall(readme) if not (ROOT / path).exists()]
    assert missing == []


DESIGN = DOCS / "design.md"
# A line of the tree: its drawing, then a name, then what the module is for.
TREE_LINE = re.compile(r"^(?P<drawing>[│├└─\s]*)(?P<name>[\w.]+/?)")


def design_tree() -> set[str]:
    """The files the design page's module tree shows, as paths under src/dmutex."""
    tree = re.search(r"```text\nsrc/dmutex/\n(.*?)```", DESIGN.read_text(), flags=re.DOTALL)
    assert tree is not None, "the design page draws src/dmutex/"
    files: set[str] = set()
    folders: list[str] = []
    for line in tree[1].splitlines():
        match = TREE_LINE.match(line)
        assert match is not None, line
        depth = len(match["drawing"]) // 4 - 1
        assert depth >= 0, line
        del folders[depth:]
        name = match["name"]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            files.add("/".join([*folders, name]))
    return files


def test_the_design_page_draws_the_source_tree() -> None:
    """The module tree on the design page lists every module under src/dmutex, and no other."""
    package = ROOT / "src" / "dmutex"
    modules = {path.relative_to(package).as_posix() for path in package.rglob("*.py")}
    assert design_tree() == modules
