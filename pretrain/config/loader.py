"""Load, override, type-check, validate and save `GLM5Config`.

Pipeline of `load_config(path, overrides)`:
  1. read the YAML file with OmegaConf's loader (YAML 1.2-style floats: `1e-5` is a float, not a string);
  2. follow `base:` (a path relative to the file, chains allowed, cycles rejected) and merge each
     section's keys over the base's;
  3. apply dotted command-line overrides `section.key=value` (values parsed as YAML);
  4. resolve OmegaConf interpolations such as `${model.hidden_size}`;
  5. build the dataclasses of `schema.py` with our own type check (`pretrain.config.types`: OmegaConf
     structured configs cannot hold the schema's Union types, and we want errors that name the file a
     bad value came from); a `Literal[...]` field's error lists the allowed values;
  6. `validate_config`.

Every key is checked against the schema as soon as it is read, so a typo is reported together with
the file or override it came from and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple, Union

import yaml
from omegaconf import OmegaConf

from pretrain.atomic_io import atomic_write_text
from pretrain.config.errors import ConfigError
from pretrain.config.schema import SECTIONS, GLM5Config
from pretrain.config.types import coerce
from pretrain.config.validation import validate_config

PathLike = Union[str, "os.PathLike[str]"]
BASE_KEY = "base"  # top-level key naming the file this one extends

# "section.key" -> where its current value came from (a file path or an override), for error messages.
Sources = Dict[str, str]


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def load_config(path: PathLike, overrides: Sequence[str] = ()) -> GLM5Config:
    """Read a YAML config (following `base:` chains), apply `section.key=value` overrides, validate."""
    if isinstance(overrides, str):  # a lone string would be iterated character by character
        overrides = [overrides]
    data, sources = _load_file(Path(path), str(path), chain=())
    _apply_overrides(data, sources, overrides)
    return _build(data, sources)


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> GLM5Config:
    """Build and validate a config from `{section: {key: value}}` (missing keys take schema defaults)."""
    merged: Dict[str, Dict[str, Any]] = {}
    sources: Sources = {}
    _merge_document(dict(data), source, merged, sources)
    return _build(merged, sources)


def config_to_dict(cfg: GLM5Config) -> Dict[str, Dict[str, Any]]:
    """Plain nested dict (sections in schema order), suitable for YAML / JSON / logging."""
    return dataclasses.asdict(cfg)


def save_config(cfg: GLM5Config, path: PathLike) -> None:
    """Write the resolved config as YAML, atomically (readers never see a half-written file)."""
    text = (
        "# Resolved GLM-5 config written by pretrain.config.save_config; load it with load_config().\n"
        + yaml.dump(config_to_dict(cfg), Dumper=_QuotingDumper, sort_keys=False, default_flow_style=False, width=100)
    )
    atomic_write_text(path, text)


class _QuotingDumper(yaml.SafeDumper):
    """Quotes number-like strings. PyYAML's own check quotes strings that *it* would read back as
    bool/int/null, but OmegaConf's loader also reads e.g. `1e5` as a float, which PyYAML leaves plain."""


_NUMBER_LIKE = re.compile(r"[-+0-9._:eE]+|[-+]?\.?(inf|Inf|INF|nan|NaN|NAN)")


def _represent_str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    style = '"' if _NUMBER_LIKE.fullmatch(s) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


_QuotingDumper.add_representer(str, _represent_str)
# Lists on one line ("moe_layer_freq: [0, 0, 1, ...]"), mappings in block style.
_QuotingDumper.add_representer(
    list, lambda dumper, v: dumper.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True)
)


# ---------------------------------------------------------------------------------------------
# reading files and overrides
# ---------------------------------------------------------------------------------------------


def _load_file(path: Path, display: str, chain: Tuple[Tuple[Path, str], ...]) -> Tuple[dict, Sources]:
    """Merged `{section: {key: value}}` of `path` and its bases; `display` is the path shown in errors."""
    resolved = path.resolve()
    if any(p == resolved for p, _ in chain):
        cycle = " -> ".join([d for _, d in chain] + [display])
        raise ConfigError(f"config 'base:' cycle: {cycle}; remove one of these 'base:' lines")
    if not path.is_file():
        via = f" (the base of {chain[-1][1]})" if chain else ""
        raise ConfigError(f"config file not found: {display}{via}")
    try:
        doc = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # YAML syntax errors, duplicate keys, ...
        raise ConfigError(f"cannot parse {display}: {e}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{display} must be a YAML mapping of sections, got {type(doc).__name__}")

    base = doc.pop(BASE_KEY, None)
    merged: Dict[str, Dict[str, Any]] = {}
    sources: Sources = {}
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"'base:' in {display} must be a file path string, got {base!r}")
        base_display = os.path.normpath(os.path.join(os.path.dirname(display), base))
        merged, sources = _load_file(path.parent / base, base_display, chain + ((resolved, display),))
    _merge_document(doc, display, merged, sources)
    return merged, sources


def _merge_document(doc: Dict[str, Any], source: str, merged: Dict[str, Dict[str, Any]], sources: Sources) -> None:
    """Check `doc`'s sections and keys against the schema and merge them over `merged` (in place)."""
    for section, body in doc.items():
        _check_section(section, source)
        if body is None:  # `model:` with nothing under it
            continue
        if not isinstance(body, dict):
            raise ConfigError(
                f"section {section} (in {source}) must be a mapping of keys, got {type(body).__name__} {body!r}"
            )
        for key, value in body.items():
            _check_key(section, key, source)
            # Values replace the base's (lists too); sections merge key by key.
            merged.setdefault(section, {})[key] = value
            sources[f"{section}.{key}"] = source


def _apply_overrides(data: Dict[str, Dict[str, Any]], sources: Sources, overrides: Iterable[str]) -> None:
    for item in overrides:
        where = f"override {item!r}"
        dotted, eq, text = item.partition("=")
        parts = dotted.strip().split(".")
        if not eq or len(parts) != 2 or not all(parts):
            raise ConfigError(f"bad {where}: write section.key=value, e.g. model.num_layers=4")
        section, key = parts
        _check_section(section, where)
        _check_key(section, key, where)
        data.setdefault(section, {})[key] = _parse_override_value(text)
        sources[f"{section}.{key}"] = where


def _parse_override_value(text: str) -> Any:
    """YAML scalar / list ("4", "1e-5", "null", "[0,1]"); text YAML cannot parse stays a string,
    so Megatron-LM's "[0]*3+[1]*75" works unquoted on the command line."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)["value"]
    except Exception:
        return text


def _check_section(section: Any, where: str) -> None:
    if section == BASE_KEY:
        raise ConfigError(f"'base:' must be a top-level key (in {where}), not a section")
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section} (in {where}){_suggest(str(section), list(SECTIONS))}")


def _check_key(section: str, key: Any, where: str) -> None:
    fields = _field_names(section)
    if key in fields:
        return
    # A valid key put in the wrong section is the most helpful suggestion.
    elsewhere = [f"{s}.{key}" for s in SECTIONS if key in _field_names(s)]
    if elsewhere:
        hint = f"; did you mean {elsewhere[0]}?"
    else:
        hint = _suggest(str(key), fields, prefix=f"{section}.")
    raise ConfigError(f"unknown key {section}.{key} (in {where}){hint}")


def _suggest(word: str, options: List[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    return f"; valid {'keys of ' + prefix.rstrip('.') if prefix else 'sections'}: {', '.join(options)}"


def _field_names(section: str) -> List[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


# ---------------------------------------------------------------------------------------------
# building typed dataclasses
# ---------------------------------------------------------------------------------------------


def _build(data: Dict[str, Dict[str, Any]], sources: Sources) -> GLM5Config:
    try:  # `${model.hidden_size}`-style interpolations; `???` marks a value that must be given
        data = OmegaConf.to_container(OmegaConf.create(data), resolve=True, throw_on_missing=True)
    except Exception as e:
        raise ConfigError(f"cannot resolve config values: {e}") from None
    sections = {}
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        body = data.get(name) or {}
        kwargs = {
            key: coerce(value, hints[key], f"{name}.{key}", sources.get(f"{name}.{key}", "?"))
            for key, value in body.items()
        }
        sections[name] = cls(**kwargs)
    cfg = GLM5Config(**sections)
    validate_config(cfg)
    return cfg
