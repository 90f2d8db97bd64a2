"""A user's own recipe, run without editing the package: a recipe.json file, or a `module:function`.

    spillway train path/to/recipe.json --set train.steps=100   # the file every checkpoint saves
    spillway train my_recipes:my_recipe --set train.steps=100  # a function returning a Recipe
    spillway plan  my_recipes:my_recipe --gpu h100

`load_recipe(spec, overrides)` reads any of the three kinds of name:

* a registered name (`tiny`, `llama3_8b`: recipes/registry.py);
* a file: a name ending in `.json`, or any existing file (a registered name
  wins over a file of that name in the current directory: `./tiny` reads the file): the JSON a
  checkpoint saves as `recipe/recipe.json` (`Recipe.to_json`), so a run can be
  reproduced elsewhere (mind its `checkpoint.dir`, which names the run it came
  from: `--set checkpoint.dir=...`);
* `module:function` (or `module.function`): the function is called with no
  arguments and must return a `Recipe`; the module is imported as a
  `--set block=` module is (PYTHONPATH, else the current directory,
  recipes/blocks.py).

`--set` overrides apply on top, as for a registered recipe. A missing file, a
file that is not JSON (its line and column), JSON that is not a recipe, a
module or function that cannot be found or raises, and a function that
returns something else are each one ConfigError naming the file or function.
"""

from __future__ import annotations

import json
from pathlib import Path

from spillway.layers.errors import ConfigError
from spillway.recipes.blocks import ModuleNotHere, where_the_block_is_needed
from spillway.recipes.config import Recipe, apply_overrides


def is_recipe_file(spec: str) -> bool:
    # "dir.json/" too: a path with a slash at its end is a path, whose refusal names the folder
    return spec.lower().rstrip("/").endswith(".json") or Path(spec).expanduser().is_file()


def recipe_from_file(spec: str) -> Recipe:
    path = Path(spec).expanduser()
    if not path.is_file():
        why = "is a folder, not a recipe file" if path.is_dir() else f"does not exist{_step_gone(path)}"
        raise ConfigError(f"recipe file {path} {why}")
    try:
        text = path.read_text(encoding="utf-8-sig")   # a BOM (Notepad saves one) is no JSON error
        tree = json.loads(text)
    except json.JSONDecodeError as error:
        # `spillway recipes NAME > FILE` wrote the description above the JSON: the first thing users try
        advice = (f"; it starts with `spillway recipes`' description: `spillway recipes NAME --json > {spec}` "
                  f"writes the JSON alone" if error.pos == 0 and "\n{" in text else "")
        raise ConfigError(f"recipe file {path}: not valid JSON (line {error.lineno}, column {error.colno}: "
                          f"{error.msg}){advice}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"recipe file {path}: cannot be read ({error})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe file {path}: a JSON {type(tree).__name__}, not a recipe (a JSON object as "
                          f"recipe/recipe.json beside every checkpoint holds)")
    try:
        return Recipe.from_dict(tree)
    except ModuleNotHere as error:
        raise ConfigError(where_the_block_is_needed(f"recipe file {path}", error)) from None
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"recipe file {path}: not a spillway recipe: {error}") from None


def recipe_from_function(spec: str) -> Recipe:
    from spillway.recipes.blocks import import_user_module

    module_name, sep, function_name = spec.partition(":")
    if not sep:
        module_name, _, function_name = spec.rpartition(".")
    # './nosuch.py' splits into module './nosuch' and function 'py': a path, not a module, so the same line
    # (importlib's "the 'package' argument is required" said nothing of the recipe name)
    if not all(part.isidentifier() for part in module_name.split(".")) or not function_name.isidentifier():
        raise ConfigError(f"recipe {spec!r}: not a registered name, a .json file or 'module:function'")
    module = import_user_module(module_name, label=f"recipe {spec}")
    function = getattr(module, function_name, None)
    if function is None:
        raise ConfigError(f"recipe {spec}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                          f"{function_name!r}")
    if isinstance(function, Recipe):
        return function   # a Recipe object itself is as good as a function returning it
    if not callable(function):
        raise ConfigError(f"recipe {spec}: {function_name!r} is of type {type(function).__name__}, not a function "
                          f"returning a Recipe")
    try:
        recipe = function()
    except (Exception, SystemExit) as error:   # the user's function raised: name it, not "internal error"; a
        # SystemExit (a script's sys.exit reached on import-time use) would end spillway with its code, 0 too
        raise ConfigError(f"recipe {spec}: calling {function_name}() failed: {type(error).__name__}: "
                          f"{error}") from None
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"recipe {spec}: {function_name}() returned an object of type {type(recipe).__name__}, not a "
                          f"spillway.recipes.config.Recipe")
    return recipe


def _step_gone(recipe_file: Path) -> str:
    """For a step's recipe.json that is gone with its step (the run's retention): the steps there now."""
    from spillway.recipes.train.checkpoint_dirs import steps_beside
    from spillway.recipes.train.checkpoint_items import RECIPE

    step = recipe_file.parent.parent
    return steps_beside(step) if recipe_file.parent.name == RECIPE and not step.exists() else ""


def _folder_is_no_recipe(spec: str) -> str:
    """What a folder given where a recipe goes is, and what to give instead: a run's folder (`spillway train
    runs/tiny` to go on with it) names the recipe file it trained with; "unknown recipe 'runs/tiny'; did you mean
    'tiny'?" sent users to another run."""
    from spillway.models.hf import is_hf_checkpoint_folder, peft_adapter_base
    from spillway.recipes.train.checkpoint_dirs import CheckpointError, resolve_step_dir, run_dir_of
    from spillway.recipes.train.checkpoint_items import RECIPE, RECIPE_FILENAME

    path = Path(spec).expanduser()
    if (base := peft_adapter_base(path)) is not None:
        return (f"{spec} is a PEFT adapter (adapter_config.json) of {base}, not a recipe: fine-tune from the run "
                f"it was exported from, or from its merged export (checkpoint.init_from=hf:FOLDER)")
    if is_hf_checkpoint_folder(path):
        return (f"{spec} is a Hugging Face checkpoint folder, not a recipe: fine-tune from it with a recipe of its "
                f"family and --set checkpoint.init_from=hf:{spec} (README, \"Fine-tune\")")
    try:
        step = resolve_step_dir(path)
    except CheckpointError:
        step = None
    if step is None or not (recipe_file := step / RECIPE / RECIPE_FILENAME).is_file():
        return (f"recipe {spec!r} is a folder, not a recipe: give a registered name (`spillway recipes` lists them), "
                f"a recipe .json file or 'module:function'")
    run = run_dir_of(step) or path
    what = "a step folder of a spillway run" if Path(step).samefile(path) else "a spillway run's folder"
    return (f"{spec} is {what}, not a recipe: the recipe it trained with is {recipe_file}; to go on with the run, "
            f"copy it out of the step folder (which the run's retention removes), `cp {recipe_file} recipe.json`, "
            f"then `spillway train recipe.json --set checkpoint.dir={run}`; generate and export take the run's folder")


def load_recipe(spec: str, overrides: list[str] = ()) -> Recipe:
    """The recipe `spec` names (module docstring), with `overrides` ("a.b=value") applied."""
    from spillway.recipes.registry import get_recipe, recipe_names

    if spec in recipe_names():
        return get_recipe(spec, list(overrides))
    if Path(spec).expanduser().is_dir() and not is_recipe_file(spec):   # "dir.json/" is named as a recipe file
        raise ConfigError(_folder_is_no_recipe(spec))
    if is_recipe_file(spec):
        recipe = recipe_from_file(spec)
    elif ":" in spec or "." in spec:
        recipe = recipe_from_function(spec)
    else:
        return get_recipe(spec, list(overrides))   # an unknown name: its error lists the known ones
    return apply_overrides(recipe, list(overrides))
