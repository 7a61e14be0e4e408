"""The config package's exception type and the tiny helpers every check uses."""

from typing import Any


class ConfigError(ValueError):
    """A config file, override or value is wrong; the message names the key and says what to change."""


def show(value: Any) -> str:
    """A value as the user wrote it in YAML (null, not None)."""
    return "null" if value is None else str(value)


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)
