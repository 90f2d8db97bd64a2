"""No function in the package is longer than 100 lines (read with `ast`, nothing imported).

A function past a screenful holds several concerns; split it into the phases it runs (the train loop,
recipes/train/loop.py, reads as its phases). `KNOWN_LONGER` lists the functions still over the limit,
each to be split; the test fails if one grows into the list or one listed is split and still listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("layers", "models", "recipes", "data")
LIMIT = 100   # lines, from the `def` line to the last line of the body, docstring and comments included
KNOWN_LONGER: set[str] = set()


def function_lengths() -> dict[str, int]:
    lengths = {}
    for package in PACKAGE_DIRS:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{path.relative_to(REPO).as_posix()}::{node.name}"
                    lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_the_parser_sees_the_train_loop():
    lengths = function_lengths()
    assert 0 < lengths["recipes/train/loop.py::train"] <= LIMIT


def test_no_function_is_longer_than_the_limit():
    longer = {key: n for key, n in function_lengths().items() if n > LIMIT}
    new = {key: n for key, n in longer.items() if key not in KNOWN_LONGER}
    assert not new, f"functions over {LIMIT} lines (split them into the phases they run): {new}"
    split = KNOWN_LONGER - set(longer)
    assert not split, f"no longer over {LIMIT} lines, remove from KNOWN_LONGER: {sorted(split)}"
