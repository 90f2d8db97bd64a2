"""Every registered recipe builds: its model, made abstractly (nothing allocated, so the 8B recipes too), has
the parameter count the recipe reports, and its saved JSON reads back as the same recipe.

The list comes from the registry at collection time, so recipes added later are checked without editing this file.
"""

import json
import math

import jax
import pytest
from flax import nnx

from spillway.recipes.config import Recipe
from spillway.recipes.registry import get_recipe, recipe_names


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_builds_abstractly_with_the_parameter_count_it_reports(name):
    recipe = get_recipe(name)
    model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(recipe.train.seed)))
    # The model's parameters: a LoRA recipe's adapters train beside them and are not in its count.
    params = jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    assert all(isinstance(p, jax.ShapeDtypeStruct) for p in params)
    assert sum(math.prod(p.shape) for p in params) == recipe.num_params()
    assert Recipe.from_dict(json.loads(recipe.to_json())) == recipe


def test_the_registry_is_not_empty():
    assert "tiny" in recipe_names() and len(recipe_names()) >= 2
