"""The harness's pytest plugins, registered by ``tests/conftest.py`` (``pytest_plugins``).

- ``tests._support.plugins.redis``: the Redis servers (``redis_pool``,
  ``redis_server`` parametrized over every version found, ``redis_url``);
- ``tests._support.plugins.mongodb``: the MongoDB test server
  (``mongo_session``) and the strict xfails of ``mongo_servers.DEVIATIONS``.
"""
