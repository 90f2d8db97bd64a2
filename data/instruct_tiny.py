"""The small instruction set the `tiny_sft` recipe fine-tunes on: short Python functions asked for in words.

`instruct_tiny.jsonl` (beside this file, shipped with the package) holds
`instruction` / optional `input` / `output` records made here, from fixed
lists, with no randomness and no network: `python -m spillway.data.instruct_tiny`
rewrites it, and tests/data/test_sft_formats.py checks that the shipped file is
what this makes. The answers are Python the `tiny` run (trained on the standard
library's source) can learn to write within a few hundred steps.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

INSTRUCT_TINY = Path(__file__).with_name("instruct_tiny.jsonl")

# (what the function does, its name, the expression it returns over its two arguments)
_BINARY = [
    ("adds {a} and {b}", "add", "{a} + {b}"),
    ("subtracts {b} from {a}", "subtract", "{a} - {b}"),
    ("multiplies {a} by {b}", "multiply", "{a} * {b}"),
    ("divides {a} by {b}", "divide", "{a} / {b}"),
    ("returns the larger of {a} and {b}", "larger", "max({a}, {b})"),
    ("returns the smaller of {a} and {b}", "smaller", "min({a}, {b})"),
    ("raises {a} to the power {b}", "power", "{a} ** {b}"),
    ("returns the remainder of {a} divided by {b}", "remainder", "{a} % {b}"),
    ("checks whether {a} equals {b}", "is_equal", "{a} == {b}"),
    ("checks whether {a} is less than {b}", "is_less", "{a} < {b}"),
]
# (what it does, its name, the expression over its one argument)
_UNARY = [
    ("returns {x} doubled", "double", "{x} * 2"),
    ("returns the square of {x}", "square", "{x} * {x}"),
    ("returns the length of {x}", "length", "len({x})"),
    ("returns {x} reversed", "reverse", "{x}[::-1]"),
    ("returns the first item of {x}", "first", "{x}[0]"),
    ("returns the last item of {x}", "last", "{x}[-1]"),
    ("returns {x} as a string", "to_string", "str({x})"),
    ("returns {x} in upper case", "upper", "{x}.upper()"),
    ("returns the sum of the items of {x}", "total", "sum({x})"),
    ("returns {x} sorted", "sort", "sorted({x})"),
]
_PAIRS = [("a", "b"), ("x", "y"), ("left", "right"), ("first", "second"), ("m", "n")]
_SINGLES = ["x", "value", "items", "data", "text"]
_ASKS = ["Write a Python function that {what}.", "Write a function that {what}.", "Define a function that {what}."]


def _binary_records():
    for (what, name, expression), (a, b), ask in itertools.product(_BINARY, _PAIRS, _ASKS[:2]):
        yield {"instruction": ask.format(what=what.format(a=a, b=b)),
               "output": f"def {name}({a}, {b}):\n    return {expression.format(a=a, b=b)}\n"}


def _unary_records():
    for (what, name, expression), x, ask in itertools.product(_UNARY, _SINGLES, _ASKS):
        yield {"instruction": ask.format(what=what.format(x=x)),
               "output": f"def {name}({x}):\n    return {expression.format(x=x)}\n"}


def _named_records():
    """With an `input`: the function's name is given, the instruction says what it does."""
    for (what, _, expression), name in itertools.product(_UNARY, ["f", "g", "helper"]):
        yield {"instruction": f"Write a function with the name below that {what.format(x='its argument')}.",
               "input": name, "output": f"def {name}(x):\n    return {expression.format(x='x')}\n"}


def records() -> list[dict]:
    """Every record of the set, in file order."""
    return [*_binary_records(), *_unary_records(), *_named_records()]


def write(path: Path = INSTRUCT_TINY) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records()), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(f"wrote {len(records())} records to {write()}")
