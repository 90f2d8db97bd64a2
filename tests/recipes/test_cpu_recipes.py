"""Every family's CPU recipe trains a few steps on the embedded corpus and its loss falls.

One test for all of them (it was written three times, in the Gemma, MoE and
Mistral/Qwen recipe files): the family's model runs through the whole train
loop (data, sharded step, optimizer, checkpoint) at 96-token rows for 8 steps.
What is particular to a family's recipe (a sliding window that shapes the
model, local and global layers, MoE runs) is checked without training, for
every recipe, in the default suite. The default suite trains `gemma3_tiny`
(local and global layers: the most varied stack); the others train in
`make test-slow` (25-50 s each on 2 cores). `gpt2_tiny`'s run, which also
checks its evaluation and saved recipe, is in test_gpt2_recipes.py, and
`tiny`'s in recipes/train/test_train.py.
"""

import pytest

from spillway.recipes.registry import get_recipe
from spillway.recipes.train.loop import train

# recipe -> its family
CPU_RECIPES = {"gemma3_tiny": "gemma3", "gemma2_tiny": "gemma2", "mistral_tiny": "mistral", "qwen2_tiny": "qwen2",
               "qwen3_tiny": "qwen3", "mixtral_tiny": "mixtral", "qwen3_moe_tiny": "qwen3_moe"}
TRAINED_BY_DEFAULT = "gemma3_tiny"
RUN = ["data.source=builtin:stdlib:400000", "data.seq_len=96", "data.num_proc=1", "data.val_fraction=0.1",
       "model.vocab_size=512", "train.global_batch=8", "train.steps=8", "train.log_every=1", "train.eval_every=8",
       "train.eval_batches=1", "train.sample_tokens=0", "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2",
       "checkpoint.every_steps=8"]


def _has_moe(recipe) -> bool:
    return any(run.block.moe is not None for run in recipe.decoder_spec().stack_runs())


def _window_shapes_the_model(recipe) -> bool:
    return recipe.model.sliding_window < recipe.data.seq_len


# What each recipe must be at the run's shapes, for its training to test what it is there for.
SHAPES = {
    "gemma3_tiny": lambda r: _window_shapes_the_model(r) and set(r.model.layer_kinds()) == {"L", "G"},
    "gemma2_tiny": lambda r: _window_shapes_the_model(r) and set(r.model.layer_kinds()) == {"L", "G"},
    "mistral_tiny": _window_shapes_the_model,
    "qwen2_tiny": lambda r: not _has_moe(r),
    "qwen3_tiny": lambda r: not _has_moe(r),
    "mixtral_tiny": _has_moe,
    "qwen3_moe_tiny": _has_moe,
}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spillway-cache")


def run_recipe(name, data_cache, run_dir):
    return get_recipe(name, [*RUN, f"data.cache_dir={data_cache}", f"checkpoint.dir={run_dir}"])


@pytest.mark.parametrize("name", sorted(CPU_RECIPES))
def test_cpu_recipe_is_its_family_with_what_the_run_exercises(name, tmp_path):
    recipe = run_recipe(name, tmp_path / "cache", tmp_path / "run")
    assert recipe.family == CPU_RECIPES[name]
    assert SHAPES[name](recipe), name


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name == TRAINED_BY_DEFAULT else pytest.mark.slow)
                                  for name in sorted(CPU_RECIPES)])
def test_cpu_recipe_trains_and_its_loss_falls(name, data_cache, tmp_path):
    result = train(run_recipe(name, data_cache, tmp_path), progress=False)
    losses = {row["step"]: row["loss"] for row in result.history if "loss" in row}
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.5, losses
