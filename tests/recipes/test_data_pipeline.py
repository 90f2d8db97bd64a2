"""The recipe-to-data glue: settings reach the data package, and what it cannot run yet is refused."""

import pytest

from spillway.recipes.registry import get_recipe
from spillway.recipes.train.data_pipeline import prepare


def test_a_mixture_recipe_is_refused_not_ignored():
    recipe = get_recipe("tiny", ["data.mixture=web=0.7:/data/web,code=0.3:builtin:stdlib"])
    assert recipe.data.mixture == "web=0.7:/data/web,code=0.3:builtin:stdlib"
    with pytest.raises(ValueError, match="data.mixture=.*not wired into the train loop yet; use data.source"):
        prepare(recipe)
