"""The train step's XLA settings (recipes/train/xla_settings.py): names this jaxlib knows, carried by the one
jitted step on GPU platforms (so training and the planner's compiles share them), absent on CPU."""

import jax
import jax.numpy as jnp
import pytest

from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import xla_settings
from spillway.recipes.train.step import abstract_setup, abstract_step_arguments


def test_every_setting_is_an_option_this_jaxlib_knows():
    # An unknown name fails the compile ("No such compile option"); these compile.
    f = jax.jit(lambda x: x * 2, compiler_options=xla_settings.step_compiler_options("cuda"))
    assert float(f(jnp.ones(()))) == 2.0
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x * 2, compiler_options={"xla_gpu_not_an_option": True})(jnp.ones(()))


@pytest.mark.parametrize("platform, expected", [("cuda", xla_settings.STEP_OPTIONS), ("cpu", {})])
def test_the_train_step_carries_the_settings_on_a_gpu_only(platform, expected):
    recipe = get_recipe("tiny", ["model.num_layers=1", "train.global_batch=2", "data.seq_len=16"])
    s = abstract_setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), platform=platform)
    lowered = s.train_step.lower(*abstract_step_arguments(s))
    # The jit's options travel with its lowering and are merged into any .compile(compiler_options=...).
    assert dict(lowered._lowering._compiler_options_kvs) == expected
