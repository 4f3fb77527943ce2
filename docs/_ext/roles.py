"""A griffe extension for the API reference: the docstrings' Sphinx roles, in Markdown.

dmutex's docstrings name other objects the Sphinx way (:class:`~dmutex.Clock`),
which mkdocstrings would print as written. This extension rewrites each role
before rendering: a public name (one of ``dmutex.__all__``) becomes a link to
its entry on the API page, anything else inline code. ``~`` keeps only the
last component, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

import dmutex

ROLE = re.compile(r":(?:class|func|data|attr|meth|mod|exc|obj):`(~?)([^`]+)`")
PUBLIC = frozenset(dmutex.__all__)


def markdown(match: re.Match[str]) -> str:
    """The Markdown for one role: a link to a public name, else inline code."""
    short, target = match[1] == "~", match[2]
    shown = target.rsplit(".", 1)[-1] if short else target
    name = target.removeprefix("dmutex.")
    if name in PUBLIC:
        return f"[`{shown}`][dmutex.{name}]"
    return f"`{shown}`"


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's Sphinx roles as Markdown, as each object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(markdown, obj.docstring.value)
