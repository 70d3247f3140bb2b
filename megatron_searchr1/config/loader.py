"""The generic half of the configuration: YAML + dotted `key=value` overrides into nested dataclasses.

Nothing here knows the RL or SFT schema; `rl.py` and `sft.py` declare the sections, this module builds them,
coerces the values to each field's annotated type, writes the resolved config back as YAML and prints the
field docstrings for `--help-config`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Optional

import yaml

from megatron_searchr1.field_docs import field_docs


class ConfigError(ValueError):
    """A configuration mistake; the message names the field and what to change."""


def check(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`: the one form of every section's checks (rl.py, sft.py).

    >>> check(True, "never shown")
    >>> check(1 > 2, "trainer.total_steps must be >= 0")
    Traceback (most recent call last):
    ...
    megatron_searchr1.config.loader.ConfigError: trainer.total_steps must be >= 0
    """
    if not ok:
        raise ConfigError(message)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key set twice in one mapping: PyYAML keeps the last silently, so a second
    `trainer:` section would replace the first whole (and a repeated field would win unseen). Merge keys (`<<:`)
    are left to PyYAML."""

    path = "the config"

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error says so
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                what = "section" if isinstance(value_node, yaml.MappingNode) else "key"
                raise ConfigError(f"{self.path}:{line}: {what} {key!r} appears a second time (first on line {first}); "
                                  f"YAML would keep only the last one: merge the two into one {key!r}")
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: str):
    """The YAML document in `path`; a ConfigError names the line of a duplicated key or section."""
    loader_cls = type("_Loader", (_UniqueKeyLoader,), {"path": path})
    with open(path) as f:
        return yaml.load(f, Loader=loader_cls)  # noqa: S506 - a SafeLoader subclass


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the field's annotated type (only the types our configs use)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(inner, value, where)
    if origin in (list, tuple):
        if value is None:  # `field=null` or an empty YAML key: no items (not one item "None")
            value = []
        if isinstance(value, str):
            value = _parse_scalar_list(value)
        if not isinstance(value, (list, tuple)):
            value = [value]
        elem = args[0] if args else str
        out = [_coerce(elem, v, where) for v in value]
        return tuple(out) if origin is tuple else out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        try:
            out = tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a {tp.__name__}, got {value!r}") from None
        if tp is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return out
    if tp is str:
        return str(value)
    return value


def _parse_scalar_list(text: str) -> list:
    """`[a, b]` or `a,b` from a command line."""
    text = text.strip()
    if text.startswith("["):
        return list(yaml.safe_load(text) or [])
    return [t.strip() for t in text.split(",") if t.strip()]


def _build(cls, raw: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        hint = difflib.get_close_matches(unknown[0], names, n=1)
        raise ConfigError(f"unknown field {where}{unknown[0]}" + (f" (did you mean {where}{hint[0]}?)" if hint else "")
                          + f"; fields of {where.rstrip('.') or 'the config'}: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in raw.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{name} is a section: set its fields, e.g. {where}{name}.FIELD=VALUE")
            kwargs[name] = _build(tp, value, f"{where}{name}.")
        else:
            kwargs[name] = _coerce(tp, value, f"{where}{name}")
    return cls(**kwargs)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b=c` strings into the nested dict (values parsed as YAML scalars: numbers, true/false, null, lists)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. rollout.max_turns=4)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node[parts[-1]] = value
    return raw



def load(cls, path: Optional[str] = None, overrides: Optional[list[str]] = None, translate=None):
    """Read the YAML (if any), apply dotted overrides, build and check each section of the dataclass `cls`.
    `translate(raw) -> raw`: a foreign schema read into ours after the overrides (SFT: llamafactory.py)."""
    raw: dict = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            raw = read_yaml(path) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections (data:, model:, ...)")
    raw = apply_overrides(raw, list(overrides or []))
    if translate is not None:
        raw = translate(raw)
    try:
        return _build(cls, raw, "")
    except TypeError as e:  # a dataclass rejecting its arguments
        raise ConfigError(str(e)) from None


def to_dict(cfg) -> dict:
    """Plain nested dict (tuples as lists) for YAML/JSON."""
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def save_config(cfg, path: str) -> None:
    """Write the resolved config as YAML (what the run actually used)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)



def describe(cls, prefix: str = "") -> list[str]:
    """`section.field (default): docstring` lines for --help-config."""
    docs = field_docs(cls)
    lines = []
    defaults = cls()
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            lines += describe(type(value), f"{prefix}{f.name}.")
        else:
            lines.append(f"{prefix}{f.name} (default: {value!r}): {docs.get(f.name, '')}")
    return lines
