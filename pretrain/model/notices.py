"""Once-per-process notices: a slower or different path taken because something is missing or unsupported is said
in the log, once, never silently (the model's modules share this one helper)."""

from __future__ import annotations

import warnings

_SAID = set()


def warn_once(message: str, stacklevel: int = 1) -> None:
    """A RuntimeWarning with `message`, the first time it is given in this process; `stacklevel` 1 points at the
    caller of warn_once, 2 at its caller, and so on."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


__all__ = ["warn_once"]
