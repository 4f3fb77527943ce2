"""Who holds a lease: the stamp a token carries (``dmutex._core.stamps``), written and read."""

from __future__ import annotations

import socket
import uuid

import pytest

from dmutex import DMutex, InMemoryBackend, ManualClock
from dmutex._core.stamps import (
    MAX_TOKEN_LENGTH,
    NO_STAMP,
    Stamp,
    Stamper,
    encode_identity,
    read_stamp,
)

RANDOM = "3f2a9c1e-5b7d-4e0a-9c4f-0d6b8e2a7c11"
SINCE = 1_796_648_205_640


def token_for(identity: str, since: int = SINCE) -> str:
    return RANDOM + Stamper(identity).suffix(since)


@pytest.mark.parametrize(
    "identity",
    ["web-1:4242", "worker 7 (cron) backup.sh --full", "ünï|%{x}/~", "a" * 77, "\t\n\x00"],
)
def test_an_identity_reads_back_as_written(identity: str) -> None:
    token = token_for(identity)
    assert len(token) <= MAX_TOKEN_LENGTH
    assert read_stamp(token) == Stamp(identity, SINCE)


def test_a_stamp_holds_printable_ascii_without_separator_escape_or_braces() -> None:
    token = token_for("ünï|%{x}\n")
    identity = token.split("|", 2)[2]
    assert identity.isascii()
    assert identity.isprintable()
    assert not set("|{}") & set(identity)
    # Every byte but those of "n" and "x": ü and ï are two each, then | % { } and the newline.
    assert identity.count("%") == 9


@pytest.mark.parametrize("length", [78, 90, 200, 1000])
@pytest.mark.parametrize("char", ["a", "é", "€", "😀"])
def test_a_long_identity_is_cut_to_fit_never_inside_an_escape(length: int, char: str) -> None:
    token = token_for(char * length)
    assert len(token) <= MAX_TOKEN_LENGTH
    encoded = token.split("|", 2)[2]
    assert encoded.endswith("...")
    body = encoded.removesuffix("...")
    assert "%" not in body[-2:], "an escape cut in two"
    read = read_stamp(token).identity
    assert read is not None
    assert read.endswith("...")
    assert set(read.removesuffix("...")) <= {char}


def test_an_empty_identity_stamps_nothing() -> None:
    assert Stamper("").suffix(SINCE) == ""
    assert encode_identity("") == ""


@pytest.mark.parametrize(
    "token",
    [
        RANDOM,  # the TypeScript library's
        "my own token",
        RANDOM + "|",
        RANDOM + "|12x|who",
        RANDOM + "|99999999999999|who",  # more digits than a millisecond time has
        RANDOM + "|123",
        "x" * 36 + "-123|who",
        "",
    ],
)
def test_a_token_without_a_stamp_reads_as_nobody(token: str) -> None:
    assert read_stamp(token) == NO_STAMP


def test_the_default_identity_is_host_and_pid_and_follows_a_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stamper = Stamper(None)
    host = socket.gethostname()
    first = read_stamp(RANDOM + stamper.suffix(SINCE)).identity
    assert first is not None
    assert first.startswith(f"{host}:")
    monkeypatch.setattr("dmutex._core.stamps.os.getpid", lambda: 4_194_303)
    assert read_stamp(RANDOM + stamper.suffix(SINCE)).identity == f"{host}:4194303"
    fixed = Stamper("me")
    assert read_stamp(RANDOM + fixed.suffix(SINCE)).identity == "me", "a given identity stays"


def test_a_grant_is_stamped_by_the_instance_clock() -> None:
    clock = ManualClock()
    clock.advance(1234.5678)
    backend = InMemoryBackend(clock=clock)
    lock = DMutex("svc", backend, identity="batch").acquire("job")
    assert lock is not None
    random, since, identity = lock.token.split("|")
    assert uuid.UUID(random).version == 4
    assert (int(since), identity) == (round(clock.time() * 1000), "batch")
    (holder,) = DMutex("svc", backend).holders("job")
    assert holder.identity == "batch"
    assert holder.since is not None
    assert holder.since.timestamp() == int(since) / 1000
