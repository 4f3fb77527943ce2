"""DynamoDB's URL for the ``dmutex`` command: ``dynamodb://[REGION][?endpoint=URL&profile=NAME]``.

Rules:

1. ``dynamodb://REGION``: the AWS region (``dynamodb://eu-west-1``), a
   name as botocore takes one (letters, digits and inner ``-``, at most 63,
   not all digits). None (``dynamodb://``): ``AWS_REGION``, which botocore
   does not read (the AWS CLI and the other SDKs do, before
   ``AWS_DEFAULT_REGION``), else botocore's own lookup: ``AWS_DEFAULT_REGION``,
   then the profile's ``region``. No region anywhere is a usage error.
2. Two query parameters, each at most once and not empty:
   ``endpoint=http(s)://HOST[:PORT][/PATH]``, the endpoint to send requests
   to (DynamoDB Local, or another server that speaks DynamoDB's protocol),
   and ``profile=NAME``, the profile of the AWS config files to take
   credentials and settings from (else ``AWS_PROFILE``, else the default
   one). Without ``endpoint=``, botocore finds the endpoint itself:
   ``AWS_ENDPOINT_URL_DYNAMODB``, ``AWS_ENDPOINT_URL``, the profile's
   ``endpoint_url``, else the region's DynamoDB; a URL's ``endpoint=`` wins
   over them.
3. No credentials in the URL: a user or password (of the URL or of its
   endpoint) is refused, without showing it; botocore finds them (the
   ``AWS_ACCESS_KEY_ID`` variables, the profile, SSO, the instance's role,
   ...). A path other than ``/``, a fragment, a port after the region or
   any other parameter is refused too, all by the parse, before any I/O.
   The tables are the library's, named by ``--service``
   (``_dmutex_<service>``, ...): the URL names none.
4. One boto3 client, made from a session of its own, whose botocore
   config is explicit (:func:`dynamodb_config`): botocore's standard retry
   mode, 3 attempts in all, and each attempt bounded by a connect timeout
   of the request timeout (at most 5 s) and a read timeout of the request
   timeout; ``AWS_MAX_ATTEMPTS`` and ``AWS_RETRY_MODE`` do not apply. The
   client connects on its first request (no credentials found surfaces
   there too); an endpoint, region or profile botocore refuses as it makes
   the client is a usage error, credentials it fails to load (an expired
   SSO token, a credential process that fails) make the backend unusable
   (status 69).

Caveat: a request is bounded per attempt, not in all: with its retries
and their backoff, a renewal may take longer than the request timeout.
``run`` still stops the command by the lease's deadline, which does not
wait for a renewal to answer.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from ..address import (
    Address,
    BadURL,
    Connection,
    Unreachable,
    URLForm,
    missing,
    one_line,
    redact,
)

__all__ = ["ATTEMPTS", "FORM", "PARAMS", "Target", "dynamodb_config", "region_of", "target"]

PARAMS = ("endpoint", "profile")  # the query parameters of a dynamodb: URL (rule 2)
ATTEMPTS = 3  # every request's attempts in all, the first included (rule 4)
REGION_VARIABLE = "AWS_REGION"  # read here: botocore reads AWS_DEFAULT_REGION only (rule 1)
FORM_TEXT = "dynamodb://[REGION][?endpoint=URL&profile=NAME]"

# botocore's rule for a region name (``botocore.utils.validate_region_name``).
_REGION = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)")
# A user and password in any URL of the text, plain or percent-encoded (an endpoint's).
_USERINFO = re.compile(
    r"(?i)(?P<head>(?://|%2F%2F)[^/?#@&=]*?(?::|%3A))(?P<secret>[^/?#@&]*?)(?P<at>@|%40)"
)


@dataclass(frozen=True)
class Target:
    """What a ``dynamodb:`` URL names: each None when the URL leaves it to the environment."""

    region: str | None
    endpoint: str | None
    profile: str | None


def _hidden(url: str) -> str:
    """``url`` as a message may show it: every password, the endpoint's too, as ``***``."""
    return _USERINFO.sub(r"\g<head>***\g<at>", redact(url))


def _endpoint(value: str, bad: Callable[[str], BadURL]) -> str:
    """The ``endpoint=`` value, checked (rule 2); ``bad(why)`` is the error to raise."""
    try:
        parts = urlsplit(value)
        host, port = parts.hostname, parts.port
    except ValueError as error:  # a port out of range or not a number, a bad IPv6 address
        raise bad(f"endpoint=: {one_line(error)}") from None
    if parts.username is not None or parts.password is not None:
        raise bad("endpoint= carries credentials: botocore finds them, never the URL")
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise bad("endpoint= is a server's http:// or https:// URL: http://HOST:PORT")
    if port == 0:
        raise bad("endpoint=: port 0 is not 1-65535")
    if parts.query or parts.fragment:
        raise bad("endpoint= takes no query or fragment")
    return value


def target(url: str) -> Target:
    """The region, endpoint and profile a ``dynamodb:`` URL names, checked (rules 1-3); no I/O."""
    shown = _hidden(url)

    def bad(why: str) -> BadURL:
        return BadURL(f"bad DynamoDB URL {shown}: {why}")

    try:
        parts = urlsplit(url)
    except ValueError as error:  # an unclosed "[" in the region
        raise bad(one_line(error)) from None
    if "@" in parts.netloc:
        raise bad(
            "credentials do not go in the URL: botocore finds them (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ?profile=NAME, ...)"
        )
    if not url[len(parts.scheme) + 1 :].startswith("//") and parts.path:
        raise bad(f"write {FORM_TEXT}")
    if parts.path not in ("", "/"):
        raise bad(f"it takes no path: {FORM_TEXT}")
    if parts.fragment:
        raise bad("it takes no #fragment")
    region = parts.netloc or None
    if region is not None and ":" in region:
        raise bad("a region has no port: a server's address goes in ?endpoint=http://HOST:PORT")
    if region is not None and not _REGION.fullmatch(region):
        raise bad(f"{region!r} is not a region name (us-east-1, eu-west-1, ...)")
    found: dict[str, str] = {}
    for item in parts.query.split("&") if parts.query else []:
        name, _, value = (unquote(text) for text in item.partition("="))
        if name not in PARAMS:
            raise bad(
                f"unknown parameter {name!r}: a dynamodb: URL takes only endpoint=URL and "
                "profile=NAME"
            )
        if name in found:
            raise bad(f"{name}= is given twice")
        if not value:
            raise bad(f"{name}= needs a value")
        found[name] = value
    endpoint = found.get("endpoint")
    if endpoint is not None:
        _endpoint(endpoint, bad)
    return Target(region, endpoint, found.get("profile"))


def region_of(given: Target, env: Mapping[str, str]) -> str | None:
    """The URL's region, else ``AWS_REGION``; None leaves it to botocore (rule 1)."""
    return given.region or env.get(REGION_VARIABLE, "").strip() or None


def dynamodb_config(timeout: float) -> dict[str, Any]:
    """The ``botocore.config.Config`` arguments for ``timeout`` seconds an attempt (rule 4)."""
    return {
        "retries": {"mode": "standard", "total_max_attempts": ATTEMPTS},
        "connect_timeout": min(timeout, 5.0),
        "read_timeout": timeout,
    }


def _parse(url: str) -> Address:
    target(url)
    return Address("dynamodb", url, _hidden(url))


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """A boto3 client of its own session (rule 4); it connects on its first request."""
    try:
        import boto3.session
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise missing(address, "boto3", "dmutex[dynamodb]") from None
    given = target(address.url)
    region = region_of(given, os.environ)
    refused = (
        botocore.exceptions.ProfileNotFound,
        botocore.exceptions.NoRegionError,
        botocore.exceptions.InvalidRegionError,
        botocore.exceptions.InvalidConfigError,
        ValueError,  # an endpoint botocore refuses: "Invalid endpoint: ..."
    )
    try:
        session = boto3.session.Session(profile_name=given.profile)
        client = session.client(
            "dynamodb",
            region_name=region,
            endpoint_url=given.endpoint,
            config=botocore.config.Config(**dynamodb_config(timeout)),
        )
    except botocore.exceptions.NoRegionError:
        raise BadURL(
            f"no AWS region for {address.shown}: name one (dynamodb://REGION), or set "
            "AWS_REGION or AWS_DEFAULT_REGION, or the profile's region"
        ) from None
    except refused as error:
        raise BadURL(f"cannot use {address.shown}: {one_line(error)}") from None
    except botocore.exceptions.BotoCoreError as error:  # credentials that failed to load
        raise Unreachable(f"cannot use {address.shown}: {one_line(error)}") from None
    errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)
    return Connection(address, client, errors, closer=client.close)


FORM = URLForm(
    schemes=("dynamodb",),
    shown=("dynamodb://",),
    help=(
        "dynamodb://[REGION] (?endpoint=URL: another server, as DynamoDB Local; "
        "?profile=NAME; credentials as boto3 finds them)"
    ),
    listing=(
        "DynamoDB: a strongly consistent Scan of the service's table, a page (1 MB) a request, "
        "until enough keys are found or the table ends"
    ),
    parse=_parse,
    connect=_connect,
)
"""``dynamodb://`` URLs."""
