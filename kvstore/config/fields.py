"""Turn a TOML table into a frozen config dataclass, failing with the name of the wrong key.

Every config section is a frozen dataclass whose field names carry their units (`ttl_seconds`,
`capacity_bytes`). `parse_section` checks unknown keys, types and `Literal` choices, recurses
into nested dataclasses and `dict[str, Dataclass]` tables, then calls the dataclass's own
`validate()` (if any) for cross-field rules. A section's `validate()` raises `ConfigError` with
the dotted key. Nothing here reads files.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from kvstore.errors import ConfigError, ConfigErrors

T = TypeVar("T")


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (tuple, list):
        return "a list"
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "absent"
    return getattr(tp, "__name__", str(tp))


# TOML's integers are 64-bit; Python's tomllib reads any length. A larger one passed as a count or
# a byte size overflowed torch, numpy or gRPC only once the service ran (a traceback, or every call
# failing), and as a float key it overflowed float() here.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A value an error shows is cut to this many characters (a 300-digit number is no help to read).
SHOWN_CHARS = 60


def _require_int64(value: int, key: str) -> None:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(key, f"must be within TOML's 64-bit integers (-2**63..2**63-1), got {_shown(value)}")


def _shown(value: Any) -> str:
    """`value` as an error shows it: its repr, or what it is where that is long."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** SHOWN_CHARS:
        bits = abs(value).bit_length()  # str() refuses past 4300 digits
        digits = len(str(abs(value))) if bits < 14_000 else f"about {int(bits * math.log10(2)) + 1}"
        return f"an integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}... ({len(text)} characters)"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(key, f"must be {_describe(tp)}, got {_shown(value)}")
        return value
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arg in get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e.problem)
        raise ConfigError(key, f"must be {_describe(tp)}, got {_shown(value)}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, got {_shown(value)}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a table, got {_shown(value)}")
        _, val_tp = get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a table, got {_shown(value)}")
        return parse_section(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {_shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {_shown(value)}")
        _require_int64(value, key)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"must be a number, got {_shown(value)}")
        if isinstance(value, int):
            _require_int64(value, key)  # else float() overflowed (a traceback) past ~1e308
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {_shown(value)}")
        return value
    raise AssertionError(f"config field type {tp!r} at {key} is not supported by parse_section")


def parse_section(cls: type[T], table: Mapping[str, Any], prefix: str) -> T:
    """Build `cls` from `table`; unknown keys and wrong types raise ConfigError naming the key."""
    assert dataclasses.is_dataclass(cls)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # Every unknown key and wrong type of the file at once (a fix-one-rerun loop per typo is no way
    # to learn a config); a section's range and cross-field rules (`validate`) run once its values
    # have the right types, and stop at its first problem (a later rule may assume an earlier one).
    errors: list[ConfigError] = []
    for name in sorted(set(table) - set(fields)):
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'? " if close else ""
        errors.append(ConfigError(join(prefix, name), f"unknown key ({hint}known keys: {', '.join(sorted(fields))})"))
    kwargs = {}
    for name, value in table.items():
        if name not in fields:
            continue
        try:
            kwargs[name] = _coerce(value, hints[name], join(prefix, name))
        except ConfigErrors as e:
            errors += e.errors
        except ConfigError as e:
            errors.append(e)
    if errors:
        raise ConfigErrors(errors)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(prefix)
    return obj


# Upper bounds of durations: a finite number of seconds that a clock, a timer and a deadline can
# all take (an endless or 300-year timeout overflowed them, or read as "never" where none was meant).
DAY_SECONDS = 86_400
NUL_PROBLEM = "must not contain a NUL character (no path can)"
# The most any byte budget (a tier, the embedded pool, the key memo) may be: no machine has a PiB of
# memory or one disk of it, and 2**64 bytes passed validation, then failed the arena's allocation
# with torch's C++ traceback.
MAX_CAPACITY_BYTES = 1 << 50
# Every TTL of local (sliding-window) state, the pool's and a tenant's alike: a snapshot held
# longer is memory spent on a session long gone.
MAX_LOCAL_TTL_SECONDS = 30 * DAY_SECONDS


def require(cond: bool, key: str, problem: str) -> None:
    """Raise ConfigError(key, problem) unless cond holds. For `validate()` methods."""
    if not cond:
        raise ConfigError(key, problem)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
