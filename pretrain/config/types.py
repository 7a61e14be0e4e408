"""The schema's field types as the config loader checks them: int, float, bool, str, `Literal[...]`,
`Optional[...]`, `Union[...]` and `List[...]`.

`coerce(value, type, key, where)` returns the value as the field's type or raises a one-line
`ConfigError` that names the key, where the value came from, what was expected (for a `Literal`, the
allowed values) and what to write. Only int -> float is converted; a quoted "4" for an int is an
error, not silently accepted. The loader checks every value it reads; `validate_config` checks a
config built in Python the same way (`check_types`), so each field's rule lives on its type alone.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, List, Literal, Union

from pretrain.config.errors import ConfigError


def check_types(section: str, obj: Any) -> None:
    """Check every field of a section dataclass against its schema type (ConfigError on the first mismatch)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        coerce(getattr(obj, f.name), hints[f.name], f"{section}.{f.name}", "the config object")


def coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """`value` as schema type `tp`, or ConfigError. Only int -> float is converted; everything else
    must already have the right type (a quoted "4" for an int is an error, not silently accepted)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Union:
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        others = [a for a in arms if a is not type(None)]
        if len(others) == 1 and typing.get_origin(others[0]) in (list, List) and isinstance(value, (list, tuple)):
            return coerce(value, others[0], key, where)  # a bad element: name it, not the whole list
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return coerce(value, arm, key, where)
            except ConfigError:
                pass
        raise _type_error(value, tp, key, where)
    if origin is Literal:
        allowed = typing.get_args(tp)
        # bool is an int: true must not pass for a Literal[1], nor 1 for Literal[True]
        if any(value == a and type(value) is type(a) for a in allowed):
            return value
        raise _type_error(value, tp, key, where)
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise _type_error(value, tp, key, where)
        (elem,) = typing.get_args(tp) or (Any,)
        return [coerce(v, elem, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"schema type {tp!r} of {key} is not supported by the config loader")
    raise _type_error(value, tp, key, where)


def _type_error(value: Any, tp: Any, key: str, where: str) -> ConfigError:
    got = "null" if value is None else f"{type(value).__name__} {value!r}"
    choices = _literal_values(tp)
    if choices is not None:
        shown = "null" if value is None else repr(value)
        return ConfigError(f"{key} is {shown} (in {where}); set it to one of: {choices}")
    hint = f"set it to {_type_name(tp)}"
    if isinstance(value, str) and _type_name(tp) in ("an int", "a float", "an int or null", "a float or null"):
        hint += " (write the number without quotes)"
    return ConfigError(f"{key}: expected {_type_name(tp)}, got {got} (in {where}); {hint}")


def _literal_values(tp: Any) -> "str | None":
    """"a, b, null" for Literal[a, b] / Optional[Literal[a, b]]; None for any other type."""
    arms = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    literals = [a for a in arms if typing.get_origin(a) is Literal]
    if not literals or len(literals) + (type(None) in arms) != len(arms):
        return None
    values = [v for lit in literals for v in typing.get_args(lit)]
    if type(None) in arms:
        values.append(None)
    return ", ".join("null" if v is None else str(v) for v in values)


def _type_name(tp: Any) -> str:
    names = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string", Any: "any value"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (list, List):
        (elem,) = typing.get_args(tp) or (Any,)
        if typing.get_origin(elem) is Literal:
            return "a list of " + " / ".join(str(v) for v in typing.get_args(elem))
        return f"a list of {_type_name(elem).split(' ', 1)[1]}s"
    if origin is Literal:
        return "one of " + ", ".join(str(v) for v in typing.get_args(tp))
    if origin is Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        text = " or ".join(_type_name(a) for a in arms)
        return text + " or null" if type(None) in typing.get_args(tp) else text
    return repr(tp)
