"""What a rank says it is doing, so that a call that hangs or dies says where it was.

A stack dump says *which line* a rank was stuck on, not *what for*: every rank of a deadlocked
checkpoint save sits in some ``torch.distributed`` collective, and only the caller knows that the
collective belongs to "the save side's ``save()``".  Code on a rank says so with
:func:`activity`, a context manager of plain string fields (``side="save", call="save"``); nested
ones add to and override the outer ones.  The controller reads them back when a call fails, as
:attr:`~pytest_moe_ep.world.engine.WorldError.activity`:

- a rank that *raised*: the innermost fields the exception passed through (captured as it left
  them, before the ``with`` blocks unwound), carried in :attr:`RankError.activity
  <pytest_moe_ep.world.protocol.RankError>`;
- a rank that *hung* or *died*: the fields it had when it was given up, which the rank writes to
  its activity file each time they change (one ``pwrite`` of a few bytes: no cost a cell notices)
  and the supervisor reads.

Nothing here imports torch; outside a rank (no file attached) the fields are only kept in memory.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

__all__ = ["activity", "attach", "current", "raised_in", "read", "reset"]

Fields = dict[str, str]

#: the fields of every open :func:`activity`, outermost first.
_open: list[Fields] = []
#: the rank's activity file (``-1``: none attached; fields are kept in memory only).
_fd = -1
#: the exception last seen leaving an :func:`activity`, with the fields it left (the innermost).
_raised: tuple[BaseException, Fields] | None = None


def current() -> Fields:
    """The fields of every open :func:`activity`, inner ones winning."""
    merged: Fields = {}
    for fields in _open:
        merged.update(fields)
    return merged


def _publish() -> None:
    if _fd < 0:
        return
    data = json.dumps(current()).encode()
    with contextlib.suppress(OSError):
        os.pwrite(_fd, data, 0)
        os.ftruncate(_fd, len(data))


def attach(path: str) -> None:
    """Write this process's fields to ``path`` from now on (a rank, once, at start-up)."""
    global _fd
    _fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    _publish()


def reset() -> None:
    """Forget every field and the last exception (a rank, before each call)."""
    global _raised
    _open.clear()
    _raised = None
    _publish()


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or while handling, innermost last; bounded."""
    for _ in range(16):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


@contextlib.contextmanager
def activity(**fields: str) -> Iterator[None]:
    """Say what this rank is doing for the duration of the block (plain strings only)."""
    global _raised
    _open.append({k: str(v) for k, v in fields.items()})
    _publish()
    try:
        yield
    except BaseException as exc:
        # the innermost block an exception leaves says where it was: an outer block it passes
        # through, or one it is wrapped in (``raise ... from``), keeps that
        if _raised is None or not any(e is _raised[0] for e in _chain(exc)):
            _raised = (exc, current())
        raise
    finally:
        _open.pop()
        _publish()


def raised_in(exc: BaseException) -> Fields:
    """The fields ``exc`` (or what it wraps) left when it left its innermost :func:`activity`;
    the open fields when it left none."""
    if _raised is not None and any(e is _raised[0] for e in _chain(exc)):
        return dict(_raised[1])
    return current()


def read(path: str) -> Fields:
    """A rank's activity file as the supervisor reads it (``{}`` when absent or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {str(k): str(v) for k, v in found.items()}
