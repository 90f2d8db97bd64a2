"""A recipe's own block class (`Recipe.block`, `--set block=package.module:Class`): import, check, re-import elsewhere.

The block is named by a dotted path so that a recipe stays plain data (JSON
beside every checkpoint). The module is imported from `sys.path` as usual
(PYTHONPATH, an installed package), and, failing that, from the current
directory, which a `python -m` run would search but the `spillway` console
script does not. Every failure is one line naming what is missing.

Other processes must import the same class: the planner compiles in child
processes (recipes/plan/child.py), which inherit PYTHONPATH and the working
directory but not folders put on `sys.path` in this process. `import_root`
gives the folder this process found the module under, for the child to put
on its own path.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path


class ModuleNotHere(ValueError):
    """The user's module is on neither PYTHONPATH nor the current directory: a saved recipe naming it (a run
    trained with its own block, used from another folder) is readable where the module is."""


def where_the_block_is_needed(where, error: ModuleNotHere) -> str:
    """The line for a saved recipe (`where`) whose block's module is not found here."""
    return (f"{where}: the run was trained with its own block, and {error}: run this from the folder that holds "
            f"that module, or put that folder on PYTHONPATH")


def _split(path: str) -> tuple[str, str]:
    module_name, sep, class_name = path.partition(":")
    if not sep:
        module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name or not all(p.isidentifier() for p in module_name.split(".")):
        raise ValueError(f"block: {path!r} is not a class path like 'package.module:Class'")
    return module_name, class_name


def _is_the_module_itself(error: ModuleNotFoundError, module_name: str) -> bool:
    # Missing: the module or one of its parent packages, not something the module itself imports.
    return bool(error.name) and (module_name == error.name or module_name.startswith(error.name + "."))


def _import_raising_only_not_found(module_name: str, label: str):
    """import_module; a module that raises while importing (SyntaxError, its own error) is a ValueError naming
    it; only ModuleNotFoundError passes through, to look elsewhere."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        raise
    except (Exception, SystemExit) as error:   # the user's module raised (or called sys.exit) while importing
        raise ValueError(f"{label}: importing {module_name!r} failed: {type(error).__name__}: {error}") from None


def import_user_module(module_name: str, label: str = "block"):
    """A user's module (a block's, a recipe's): from sys.path, else the current directory; every failure a
    ValueError starting with `label`."""
    return _import(module_name, label)


def _import(module_name: str, label: str = "block"):
    try:
        return _import_raising_only_not_found(module_name, label)
    except ModuleNotFoundError as error:
        cwd = os.getcwd()
        if not _is_the_module_itself(error, module_name):
            raise ValueError(f"{label}: importing {module_name!r} failed: {error}") from None
        if cwd in sys.path or "" in sys.path:
            raise ModuleNotHere(f"{label}: no module {error.name!r} on PYTHONPATH or in the current directory "
                                f"({cwd})") from None
        sys.path.append(cwd)   # kept when it works: the module may import its siblings later
        try:
            return _import_raising_only_not_found(module_name, label)
        except ValueError:
            sys.path.remove(cwd)
            raise
        except ModuleNotFoundError as again:
            sys.path.remove(cwd)
            if _is_the_module_itself(again, module_name):
                raise ModuleNotHere(f"{label}: no module {again.name!r} on PYTHONPATH or in the current "
                                    f"directory ({cwd})") from None
            raise ValueError(f"{label}: importing {module_name!r} failed: {again}") from None


def resolve_block_class(path: str) -> type:
    """Import "package.module:Class" (or "package.module.Class") and check it is a TransformerBlock subclass."""
    from spillway.layers.block import TransformerBlock

    module_name, class_name = _split(path)
    module = _import(module_name)
    if not hasattr(module, class_name):
        raise ValueError(f"block: module {module_name!r} ({getattr(module, '__file__', '?')}) has no {class_name!r}")
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, TransformerBlock)):
        if not isinstance(cls, type):
            what = f"an object of type {type(cls).__name__}"
        else:
            bases = [b.__name__ for b in cls.__mro__[1:-1]]
            what = f"a class {cls.__name__}" + (f" based on {bases}" if bases else "")
        raise ValueError(f"block: {path!r} is {what}, not a subclass of spillway.layers.block.TransformerBlock")
    return cls


def import_root(path: str) -> str | None:
    """The sys.path folder this process imports the block's module from (None for a module with no file)."""
    module_name, _ = _split(path)
    resolve_block_class(path)
    file = getattr(sys.modules[module_name], "__file__", None)
    if file is None:
        return None
    file = Path(file).resolve()
    # a.b.c in ROOT/a/b/c.py, or the package a.b in ROOT/a/b/__init__.py: ROOT is that many folders up
    levels = module_name.count(".") + (1 if file.name == "__init__.py" else 0)
    return str(file.parents[levels])
