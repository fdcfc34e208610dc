"""Failure text on one line: the helpers every message of the engine, the matrix and the inspector
uses.

One place for how a message is cut, so a report, a JSON record and a terminal line agree.  Imports
nothing, so the no-torch inspector can use it without loading the world engine.
"""

from __future__ import annotations

__all__ = ["first_line", "shorten"]


def first_line(text: str) -> str:
    """The first line of ``text`` once stripped ("" for blank text): an exception message's
    headline."""
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else ""


def shorten(text: str, limit: int = 240) -> str:
    """One line of at most ``limit`` characters, cut at a word boundary."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3].rsplit(" ", 1)[0]
    return f"{cut}..."
