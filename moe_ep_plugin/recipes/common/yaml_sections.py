"""Strict YAML configs made of sections of typed dataclass fields, shared by every front end.

Every error names the dotted key (``moe.num_experts: ...``): unknown sections and keys, wrong types, and the
dataclasses' own checks. The trainer, the DeepSpeed example and the Megatron-Core launcher all read their YAML here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from typing import Any

import yaml

CONFIG_ERROR_EXIT = 2  # what every front door exits with on a config error (argparse's usage errors use it too)


def optional_inner(hint: Any) -> Any | None:
    """``X`` for ``Optional[X]`` / ``X | None``, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return None


def type_name(hint: Any) -> str:
    inner = optional_inner(hint)
    return f"{inner.__name__} or null" if inner is not None else getattr(hint, "__name__", str(hint))


def coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against the field type ``hint`` (int, float, bool, str, dict, list, Optional[...]);
    ints are accepted where floats are expected, and so are strings like ``3e-4`` (YAML 1.1 reads them as str)."""
    inner = optional_inner(hint)
    if inner is not None:
        if value is None:
            return None
        hint = inner
    hint = typing.get_origin(hint) or hint  # dict[str, Any] → dict
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (bool, str, dict, list) and isinstance(value, hint):
        return value
    raise ValueError(f"{key}: expected {type_name(hint)}, got {value!r} ({type(value).__name__})")


def build_section(name: str, cls: type, values: Any) -> Any:
    """Instantiate dataclass ``cls`` from the mapping ``values`` (None: all defaults); errors name ``name.key``."""
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ValueError(f"{name}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ValueError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
    coerced = {k: coerce(f"{name}.{k}", v, hints[k]) for k, v in values.items()}
    try:
        return cls(**coerced)
    except (TypeError, ValueError) as exc:  # a dataclass's own check names the key without its section
        raise ValueError(f"{name}.{exc}") from exc


def check_sections(raw: dict, known: typing.Iterable[str]) -> None:
    """Every top-level key of ``raw`` must be a known section."""
    known = list(known)
    for section in raw:
        if section not in known:
            raise ValueError(f"{section}: unknown section (known: {', '.join(known)})")


def read_yaml(path: str | None) -> dict:
    """The mapping in a YAML file (None: an empty mapping)."""
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise ValueError(f"config: no such file {path!r}")
    with open(path, encoding="utf-8") as f:
        raw = _parse(f, f"config: {path}")
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"config: {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply ``dotted.key=value`` strings (values parsed as YAML) to ``raw`` in place; returns it."""
    for item in overrides:
        key, sep, text = item.partition("=")
        *parents, name = key.strip().split(".")
        if not sep or not parents or not name:
            raise ValueError(f"override {item!r}: expected section.key=value")
        node = raw
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{'.'.join(parents[: i + 1])}: expected a mapping of keys, got {node!r}")
        node[name] = _parse(text, f"override {item!r}")
    return raw


def _parse(text: Any, where: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error is one ``ValueError`` line naming ``where`` and the position."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML{at}: {problem}") from None


def config_error(prog: str, exc: Exception) -> int:
    """Print ``exc`` as the one line ``PROG: config error: KEY: ...`` on stderr; returns the exit code, 2."""
    print(f"{prog}: config error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
    return CONFIG_ERROR_EXIT
