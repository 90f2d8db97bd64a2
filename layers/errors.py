"""The exceptions spillway raises for failures a user can cause and fix.

`SpillwayError` is the base of every *expected* failure: a bad setting, a
missing file, a checkpoint that does not match, a plan that does not fit. The
`spillway` command prints one of these as one line and exits non-zero; any
other exception is a bug and is reported as such (recipes/cli.py).

`ConfigError` is a setting that cannot work, raised while a config is built,
before anything runs; `DataError` a corpus or tokenizer that cannot be used.
Both are also ValueErrors, so code (and tests) that catch ValueError for bad
input keep working.

This module lives in `layers` because `layers` imports nothing else of ours
and every other package (models, recipes, data) may import it: one base
class for the whole project without an import cycle.
"""

from __future__ import annotations

import numbers


class SpillwayError(Exception):
    """A failure the user can fix; its message names the problem and, where known, what to do."""


class ConfigError(SpillwayError, ValueError):
    """A setting that cannot work (its message names the field, e.g. `train.steps`)."""


class DataError(SpillwayError, ValueError):
    """A corpus or tokenizer problem: a file that does not parse (named with its line), a corpus
    too small for the tokenizer asked of it, a source that cannot be reached."""


def require_positive(section: str, **values) -> None:
    """ConfigError naming `section.field` for each value that is not > 0 (None is allowed: unset)."""
    for field, value in values.items():
        if value is not None and not (_is_number(value) and value > 0):   # NaN fails too
            raise ConfigError(f"{section}.{field} must be positive, got {value!r}")


def require_positive_finite(section: str, **values) -> None:
    """ConfigError naming `section.field` for each value that is not a finite number > 0 (None is allowed)."""
    for field, value in values.items():
        if value is not None and not (_is_number(value) and 0 < value < float("inf")):
            raise ConfigError(f"{section}.{field} must be a positive finite number, got {value!r}")


def require_non_negative(section: str, **values) -> None:
    """ConfigError naming `section.field` for each value that is < 0 (None is allowed: unset)."""
    for field, value in values.items():
        if value is not None and not (_is_number(value) and value >= 0):
            raise ConfigError(f"{section}.{field} must be zero or positive, got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
