"""What `spillway plan` checks before anything is compiled: the files it will write (a minute of compiles,
then a path that cannot be written or an image format matplotlib cannot write, would lose the table), and a
recipe's own block class (built once here, abstractly, so a constructor or a forward() that cannot work is
one line naming the class, not an error in every compile process)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from spillway.layers.errors import ConfigError


def check_output_path(path: str | os.PathLike, flag: str) -> Path:
    """`path` can be written (its folder exists and takes a file); else ConfigError naming the flag and why."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; give a file name (e.g. {path / 'plan.png'})")
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{flag} {path}: {folder} {what}, so nothing can be written there "
                          f"(checked before compiling)")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".spillway-write-check-"):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as error:
        raise ConfigError(f"{flag} {path}: cannot write there ({error.strerror or error}; checked before "
                          f"compiling)") from None
    return path


def check_image_path(path: str | os.PathLike, flag: str) -> Path:
    """`path` can be written (`check_output_path`) and its suffix names an image format matplotlib writes
    (recipes/plan/chart.py draws with the Agg canvas); else ConfigError listing the formats. A name without
    a suffix is refused too: matplotlib would write another file (`plan` becomes `plan.png`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not str(path).strip():   # an unset shell variable: drawing nothing would go unsaid
        raise ConfigError(f"{flag} is empty: give the image file to write (e.g. {flag} plan.png)")
    path = Path(path)
    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    suffix = path.suffix.removeprefix(".").lower()
    if suffix not in formats:
        what = f"'{suffix}' is not an image format matplotlib writes" if suffix else "the name has no image suffix"
        raise ConfigError(f"{flag} {path}: {what}; give one of {', '.join('.' + f for f in formats)} "
                          f"(checked before compiling)")
    return check_output_path(path, flag)


def check_user_block(recipe) -> None:
    """Builds the model abstractly (nothing allocated) when the recipe names its own block class: a block
    whose constructor or forward() does not fit the contract is a ConfigError naming it (layers/stack.py)."""
    if not recipe.block:
        return
    from spillway.recipes.train.step import abstract_model

    abstract_model(recipe)


def check_params_placement(recipe) -> None:
    """offload.params=experts on a model without routed experts: the ConfigError `spillway train` gives (it
    would place nothing on host), before any compile, from the abstract model (nothing allocated)."""
    from spillway.layers.memory import EXPERTS
    from spillway.recipes.optim.param_placement import param_memories, whole_placement

    if whole_placement(recipe.offload.params) != EXPERTS:
        return
    from spillway.recipes.train.step import abstract_model

    param_memories(abstract_model(recipe)[1], recipe.offload.params)


def check_recipe_before_compiles(recipe) -> None:
    """What `spillway train` refuses in one line, refused here before any compile process starts (else once per
    process, or minutes of compiles first): a block that cannot be built, offload.params=experts without
    experts, an aux_loss coefficient that would weight nothing."""
    from spillway.recipes.train.step import check_aux_loss

    check_user_block(recipe)
    check_params_placement(recipe)
    check_aux_loss(recipe)
