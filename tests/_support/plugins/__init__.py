"""The harness's pytest plugins, registered by ``tests/conftest.py`` (``pytest_plugins``).

- ``tests._support.plugins.redis``: the Redis servers (``redis_pool``,
  ``redis_server`` parametrized over every version found, ``redis_url``);
- ``tests._support.plugins.mongodb``: the MongoDB test server
  (``mongo_session``) and the strict xfails of ``mongo_servers.DEVIATIONS``;
- ``tests._support.plugins.postgresql``: the PostgreSQL server and the
  PgBouncer in transaction mode in front of it (``postgres_session``,
  ``postgres_server``, ``postgres_schema``, ``pgbouncer_url``).
"""
