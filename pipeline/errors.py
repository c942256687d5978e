"""One exception type for everything the user can fix: the CLI prints it as one line."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Bad input or configuration; the message alone (no traceback) tells the user what to fix."""


def whole_number(name: str, value: Any, minimum: int = 1, error: type[Exception] = UserError) -> int:
    """A setting that must be an integer >= ``minimum`` (``True`` and ``1.5`` are not).

    ``error``: the stages raise ValueError (like any Python constructor); the CLI's settings UserError.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name} must be an integer >= {minimum} (got {value!r})")
    return value


class OutOfBlocks(Exception):
    """The KV pool has no free or evictable block (or state slot) left: the scheduler preempts a
    sequence or lets new ones wait. Never reaches a user."""
