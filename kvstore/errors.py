"""The exception hierarchy for environment failures and bad input.

Three kinds of error live in three places (docs/architecture.md §8):
- expected outcomes (a miss, an expired snapshot, no room) are *results*, never exceptions;
- broken invariants are `assert`s;
- the classes below are for bad input and for the environment failing under us.
Only the gRPC servicer maps these to status codes; nothing else in the code base knows gRPC.
"""

from __future__ import annotations


class KvstoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class InvalidInput(KvstoreError, ValueError):
    """A request, payload or argument is malformed. The message says what is wrong."""


class ConfigError(KvstoreError, ValueError):
    """A config file, key or value is invalid. The message names the key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key '{key}': {problem}")
        self.key = key
        self.problem = problem


class ConfigErrors(ConfigError):
    """Several config errors found in one pass, all reported at once (the first one's key is `key`)."""

    def __init__(self, errors: list[ConfigError]) -> None:
        assert errors
        super().__init__(errors[0].key, errors[0].problem)
        self.errors = errors
        if len(errors) > 1:
            self.args = (f"{len(errors)} problems:\n" + "\n".join(f"  {e}" for e in errors),)


class ConfigFileError(ConfigError):
    """The config file cannot be read, or is not TOML: said as such, not as a key."""

    def __init__(self, problem: str) -> None:
        super().__init__("<file>", problem)
        self.args = (problem,)


# Names an error lists at most (the models served, ...): engines register models at run time, and
# an error's message travels in gRPC's trailing metadata, which a client refuses past 8 KiB.
NAMES_LISTED_MAX = 20


def listed(names: set[str] | list[str]) -> str:
    """`names` sorted and comma-separated for an error message, at most `NAMES_LISTED_MAX` of them."""
    ordered = sorted(names)
    more = len(ordered) - NAMES_LISTED_MAX
    return ", ".join(ordered[:NAMES_LISTED_MAX]) + (f" and {more} more" if more > 0 else "")


class UnknownModel(InvalidInput):
    """A model or layout name that is not registered."""


class Unauthenticated(KvstoreError):
    """Missing or wrong credentials."""


class ResourceExhausted(KvstoreError):
    """Overload: too many concurrent calls or replays, or a quota that cannot be met by eviction."""


class StorageError(KvstoreError):
    """A tier's backing resource failed (disk full, LMDB error, device out of memory)."""


class StorageFull(StorageError):
    """A tier had no room for a write (its disk full, or its LMDB map): the device works."""


class Unavailable(KvstoreError):
    """A dependency is down (no runner attached, Redis unreachable, shutting down)."""
