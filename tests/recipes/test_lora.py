"""LoRA (layers/lora.py, recipes/train/lora_step.py) and `spillway export` (recipes/export.py).

The references are independent of the code under test: a fresh adapter (B = 0)
leaves the model's logits as they were; a model with adapters computes what the
merged weights W + (alpha / r) B A compute; a LoRA step's gradient reaches
the adapters only (the base comes back bit for bit); transformers loads the
merged export and computes our logits; `peft` loads the adapter export onto the
base checkpoint and computes them too.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers.errors import ConfigError
from spillway.recipes.registry import get_recipe

SMALL = ["model.vocab_size=128", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32", "data.seq_len=16",
         "execution.dtype=float32", "train.global_batch=4", "train.eval_every=0", "train.sample_tokens=0"]
ALL = "lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def lora_recipe(*extra):
    return get_recipe("tiny", SMALL + ["lora.rank=4", "lora.alpha=8", "checkpoint.init_from=/nowhere", *extra])


def test_targets_that_name_no_projection_are_one_line_naming_the_ones_there():
    with pytest.raises(ConfigError, match=r"'qkv' names no projection of the llama model; it has \['down_proj', "
                                          r"'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        lora_recipe("lora.targets=q_proj,qkv")
    with pytest.raises(ConfigError, match="checkpoint.init_from is not"):
        get_recipe("tiny", SMALL + ["lora.rank=4"])


MOE_SMALL = [o for o in SMALL if not o.startswith("model.mlp_hidden")]


@pytest.mark.parametrize("recipe, target, named", [
    ("mixtral_tiny", "w1", "block_sparse_moe.experts.{j}.w1"),
    ("qwen3_moe_tiny", "gate_proj", "mlp.experts.{j}.gate_proj"),
    ("qwen3_moe_tiny", "experts", "mlp.experts.{j}.down_proj, mlp.experts.{j}.gate_proj"),
])
def test_targets_naming_the_routed_experts_are_refused_in_one_line_naming_them(recipe, target, named):
    with pytest.raises(ConfigError, match=rf"lora.targets: '{target}' names the routed experts' "
                                          rf"{named.replace('{', '[{]').replace('}', '[}]')}.*LoRA on routed "
                                          r"experts is not supported in this version"):
        get_recipe(recipe, MOE_SMALL + ["lora.rank=4", "checkpoint.init_from=/nowhere", f"lora.targets={target}"])


def test_a_dense_mlp_target_in_an_moe_model_adapts_the_dense_layers_only():
    """Qwen3-MoE's dense layer 1 and its MoE layers share the attribute path mlp.w_gate: only the dense one
    (the run without experts) gets an adapter."""
    from spillway.recipes.train.step import abstract_model

    recipe = get_recipe("qwen3_moe_tiny", MOE_SMALL + ["lora.rank=4", "checkpoint.init_from=/nowhere",
                                                       "lora.targets=mlp.gate_proj"])
    _, state = abstract_model(recipe)
    adapted = sorted("/".join(str(k) for k in path) for path, var in nnx.to_flat_state(state)
                     if isinstance(var, nnx.LoRAParam))
    assert adapted and all("lora_w_gate" in path for path in adapted)
    assert len({path.split("/lora_w_gate")[0] for path in adapted}) == 1, adapted   # one run: the dense layer


def _with_random_b(params, seed=1):
    flat = list(nnx.to_flat_state(params))
    keys = iter(jax.random.split(jax.random.key(seed), len(flat)))
    out = []
    for path, var in flat:
        key = next(keys)
        if isinstance(var, nnx.LoRAParam) and path[-1] == "b":
            var = var.replace(0.3 * jax.random.normal(key, var.get_value().shape, var.get_value().dtype))
        out.append((path, var))
    return nnx.from_flat_state(out)


@pytest.mark.slow   # builds two models eagerly and compiles three forward passes: a minute on 2 busy cores
def test_adapters_start_as_no_change_and_compute_the_merged_weights():
    from spillway.recipes.export import merged_state

    recipe = lora_recipe(ALL)
    plain = dataclasses.replace(recipe, lora=type(recipe.lora)())
    model = recipe.build_model(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    plain_graphdef, plain_params = nnx.split(plain.build_model(nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
    # The base weights are drawn as without LoRA (adapters draw after), and B = 0 changes nothing.
    logits = lambda g, p: jax.jit(lambda p: nnx.merge(g, p)(tokens))(p)  # noqa: E731
    fresh = logits(graphdef, params)
    np.testing.assert_array_equal(fresh, logits(plain_graphdef, plain_params))
    trained = _with_random_b(params)
    with_adapters = logits(graphdef, trained)
    assert not np.allclose(with_adapters, fresh, atol=1e-3)
    merged_graphdef, merged = merged_state(recipe, trained)
    np.testing.assert_allclose(logits(merged_graphdef, merged), with_adapters, atol=2e-5, rtol=1e-5)


def test_a_lora_step_trains_the_adapters_only_with_state_for_them_only():
    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.train.batch import Batch
    from spillway.recipes.train.step import setup

    recipe = lora_recipe("lora.targets=q_proj,down_proj", "train.grad_accum=2")
    s = setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]))
    params = _with_random_b(s.params)
    opt_state = jax.jit(s.optimizer.init)(params)
    assert len(jax.tree.leaves(opt_state.mu)) == 4   # A and B of two projections
    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 128)
    # warmup: step 0 has no learning rate
    new_params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(tokens))
    new_params, opt_state, _, metrics = s.train_step(new_params, opt_state, None, Batch(tokens))
    after = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(new_params)}
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed == {p for p, v in nnx.to_flat_state(params) if isinstance(v, nnx.LoRAParam)}
    assert np.isfinite(float(metrics["loss"]))
    # A fine-tuning batch (masked targets, recipes/train/sft_batch.py) through the same step: micro-batches
    # split field by field, the loss over the step's targets.
    mask = np.zeros((4, 16), np.float32)
    mask[:, 8:] = 1
    _, _, _, masked = s.train_step(new_params, opt_state, None, Batch(tokens, mask))
    assert np.isfinite(float(masked["loss"]))


def test_a_lora_run_resumes_only_on_the_base_its_adapters_were_trained_on():
    from spillway.recipes.train.lora_state import check_same_base

    recipe = lora_recipe()
    check_same_base(recipe, recipe.to_json(), "runs/x/checkpoints/2")   # the same base: nothing to say
    other = lora_recipe("checkpoint.init_from=/elsewhere")
    with pytest.raises(ConfigError, match=r"runs/x/checkpoints/2: this LoRA run's adapters were trained on "
                                          r"checkpoint.init_from=/nowhere, but the run now names /elsewhere"):
        check_same_base(other, recipe.to_json(), "runs/x/checkpoints/2")


def test_the_adapters_share_benchmark_counts_r_times_in_plus_out_per_layer():
    from benchmarks.lora_share import share

    counted = share("tiny", 4, "q_proj,down_proj")   # tiny: 4 layers, d_model 192, 6 heads of 32, MLP 512
    assert counted["adapter_params"] == 4 * 4 * ((192 + 192) + (512 + 192))
    assert counted["adapter_moments_bytes"] == 8 * counted["adapter_params"]
