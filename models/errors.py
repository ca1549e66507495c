"""The one exception type that reaches users as a one-line message instead of a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Bad input from a user: a wrong name, a missing file, an impossible combination.

    The CLI prints ``error: <message>`` and exits non-zero; it never shows a traceback for these.
    Raise it with a message that names the bad value and, where there is a closed set, the valid choices.
    """


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_choice(kind: str, value: str, choices: Iterable[str]) -> UserError:
    """The standard error for a name outside a closed set: names the value, the nearest match, all choices."""
    choices = sorted(str(c) for c in choices)
    return UserError(
        f"unknown {kind} {value!r}{did_you_mean(value, choices)}; choose from: {', '.join(choices)}"
    )
