"""The model's modules say their notices through `pretrain.notices` (the library's one say-once)."""

from pretrain.notices import first_time, say_once, warn_once

__all__ = ["first_time", "say_once", "warn_once"]
