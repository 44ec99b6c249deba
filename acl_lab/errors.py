"""User-facing errors.

Every mistake a user can make (a bad flag, a bad config field, a broken data
file, a missing asset) is raised as :class:`AclLabError`, whose message names
the bad value, the allowed values and the fix. It subclasses ``ValueError`` so
generic handlers still catch it, and the CLI prints it without a traceback.
"""
from __future__ import annotations

from typing import Iterable


class AclLabError(ValueError):
    """A problem the user can fix; the message says what and how."""


def bad_value(what: str, value: object, allowed: str | Iterable[object], fix: str = "") -> AclLabError:
    """Build an :class:`AclLabError` that names ``what`` was wrong, the value, the allowed values and the fix."""
    if not isinstance(allowed, str):
        allowed = ", ".join(repr(a) for a in allowed)
    msg = f"{what} {value!r} is not valid; allowed: {allowed}."
    if fix:
        msg += f" Fix: {fix}"
    return AclLabError(msg)
