"""The test harness (``tests/_support``), loaded as pytest plugins: real servers and their rules."""

pytest_plugins = [
    "tests._support.plugins.redis",
    "tests._support.plugins.mongodb",
    "tests._support.plugins.postgresql",
    "tests._support.plugins.mysql",
]
