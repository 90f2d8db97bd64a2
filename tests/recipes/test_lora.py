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
    with pytest.raises(ConfigError, match=r"lora.rank=99999 is larger than the model's d_model \(32\)"):
        lora_recipe("lora.rank=99999")
    # GPT-2's projections are PEFT's names for them (Conv1D; q, k and v fused in c_attn)
    with pytest.raises(ConfigError, match=r"'q_proj' names no projection of the gpt2 model; it has \['c_attn', "
                                          r"'c_fc', 'c_proj'\]"):
        get_recipe("gpt2_tiny", ["lora.rank=4", "checkpoint.init_from=/nowhere", "lora.targets=q_proj"])
    with pytest.raises(ConfigError, match="lora.targets names q_proj more than once"):   # was saved as given
        lora_recipe("lora.targets=q_proj,v_proj,q_proj")


def test_gpt2_targets_resolve_as_peft_resolves_them():
    """lora.targets left at q_proj,v_proj (PEFT's default for Llama-shaped models) on GPT-2 is PEFT's default
    for gpt2, c_attn: one adapter over q, k and v. c_proj names both the attention's and the MLP's."""
    from spillway.recipes.lora_targets import PEFT_LLAMA_DEFAULT, hf_modules
    from spillway.recipes.config import LoraConfig

    assert LoraConfig().targets == PEFT_LLAMA_DEFAULT
    gpt2 = ["lora.rank=4", "checkpoint.init_from=/nowhere"]
    spec = get_recipe("gpt2_tiny", gpt2).lora_spec()
    assert (spec.targets, spec.fused_targets) == (frozenset(), {("attn", ("wq", "wk", "wv"))})
    spec = get_recipe("gpt2_tiny", gpt2 + ["lora.targets=c_proj,c_fc"]).lora_spec()
    assert (spec.targets, spec.fused_targets) == ({("attn", "wo"), ("mlp", "w_down"), ("mlp", "w_up")}, frozenset())
    recipe = get_recipe("gpt2_tiny", gpt2 + ["lora.targets=attn.c_attn,mlp.c_proj"])
    assert hf_modules(recipe.model, recipe.lora_spec()) == ["attn.c_attn", "mlp.c_proj"]
    # Llama keeps its q_proj, v_proj
    assert lora_recipe().lora_spec().targets == {("attn", "wq"), ("attn", "wv")}


def test_a_fused_adapter_is_one_matrix_over_its_parts():
    """GPT-2's c_attn adapter: q, k and v's terms are x A^T B_part^T with one A, B's rows in q | k | v order,
    which is PEFT's adapter of the fused [d, 3d] tensor; the attention adds each to its part."""
    from spillway.layers import lora

    spec = get_recipe("gpt2_tiny", ["lora.rank=4", "checkpoint.init_from=/nowhere"]).lora_spec()
    adapter = lora.FusedLoraAdapter(("wq", "wk", "wv"), 32, (32, 32, 32), spec, in_axis=None, rngs=nnx.Rngs(0))
    b = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    adapter.b.set_value(jnp.asarray(b))
    x = np.random.default_rng(1).normal(size=(2, 5, 32)).astype(np.float32)
    terms = adapter.deltas(("wq", "wk", "wv"), jnp.asarray(x), jnp.float32)
    whole = (x @ np.asarray(adapter.a.get_value()).T @ b.T) * spec.scale   # PEFT's c_attn term [.., 3d]
    np.testing.assert_allclose(np.concatenate([terms[p] for p in ("wq", "wk", "wv")], -1), whole, rtol=1e-5,
                               atol=1e-5)
    assert list(adapter.deltas(("wk",), jnp.asarray(x), jnp.float32)) == ["wk"]


MOE_SMALL = [o for o in SMALL if not o.startswith("model.mlp_hidden")]
MOE_LORA = ["lora.rank=4", "lora.alpha=8", "checkpoint.init_from=/nowhere"]


@pytest.mark.parametrize("recipe, target, dense, experts", [
    ("mixtral_tiny", "w1", set(), {("mlp", "w_gate")}),
    ("qwen3_moe_tiny", "gate_proj", {("mlp", "w_gate")}, {("mlp", "w_gate")}),   # its dense layer 1, and experts
    ("qwen3_moe_tiny", "mlp.gate_proj", {("mlp", "w_gate")}, set()),             # the full name: dense only
    ("qwen3_moe_tiny", "experts", set(), {("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down")}),
])
def test_targets_name_the_routed_experts_as_peft_names_them(recipe, target, dense, experts):
    spec = get_recipe(recipe, MOE_SMALL + MOE_LORA + [f"lora.targets={target}"]).lora_spec()
    assert (set(spec.targets), set(spec.expert_targets)) == (dense, experts)


def test_expert_adapters_refuse_dropout_and_streamed_weights_in_one_line():
    with pytest.raises(ConfigError, match=r"lora.dropout=0.1 with the routed experts adapted: .* set lora.dropout=0"):
        get_recipe("mixtral_tiny", MOE_SMALL + MOE_LORA + ["lora.targets=w1", "lora.dropout=0.1"])
    with pytest.raises(ConfigError, match=r"with offload.params=experts .* not supported in this version"):
        get_recipe("mixtral_tiny", MOE_SMALL + MOE_LORA + ["lora.targets=w1", "offload.params=experts",
                                                           "offload.optimizer_state=host"])


def _merged_by_hand(params, scale):
    """The base weights with W + scale * A^T B^T for every adapter (per layer, and per expert), in NumPy."""
    flat = dict(nnx.to_flat_state(params))
    merged = {}
    for path, var in flat.items():
        if isinstance(var, nnx.LoRAParam):
            continue
        value = np.asarray(var.get_value(), np.float64)
        adapter = path[:-1] + ("lora_" + path[-1],)
        if adapter + ("a",) in flat:
            a = np.asarray(flat[adapter + ("a",)].get_value(), np.float64)
            b = np.asarray(flat[adapter + ("b",)].get_value(), np.float64)
            value = value + scale * np.einsum("...ri,...or->...io", a, b).reshape(value.shape)
        merged[path] = var.replace(jnp.asarray(value, var.get_value().dtype))
    return nnx.from_flat_state(list(merged.items()))


DISPATCHES = {"dropless": ["model.moe_dispatch=dropless"],
              "blocked": ["model.moe_dispatch=dropless", "model.moe_grouped_matmul=blocked", "model.moe_block_rows=8"],
              "capacity": ["model.moe_dispatch=capacity", "model.moe_capacity_factor=4.0"]}   # E / k: none dropped


def _expert_lora_logits_match_the_merged_weights(dispatch):
    from spillway.recipes.export import merged_state

    recipe = get_recipe("mixtral_tiny", MOE_SMALL + MOE_LORA + DISPATCHES[dispatch] +
                        ["execution.dtype=float32", "lora.targets=q_proj,w1,w2,w3"])
    plain = dataclasses.replace(recipe, lora=type(recipe.lora)())
    graphdef, params = nnx.split(recipe.build_model(nnx.Rngs(0)))
    plain_graphdef = nnx.split(nnx.eval_shape(lambda: plain.build_model(nnx.Rngs(0))))[0]
    params = _with_random_b(params)
    assert any(var.get_value().ndim == 4 for path, var in nnx.to_flat_state(params)
               if isinstance(var, nnx.LoRAParam))           # [L, E, r, in]: one adapter per expert
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
    logits = lambda g, p: np.asarray(jax.jit(lambda p: nnx.merge(g, p)(tokens))(p))  # noqa: E731
    with_adapters = logits(graphdef, params)
    by_hand = logits(plain_graphdef, _merged_by_hand(params, recipe.lora.alpha / recipe.lora.rank))
    np.testing.assert_allclose(with_adapters, by_hand, atol=2e-5, rtol=1e-5)
    assert not np.allclose(with_adapters, logits(graphdef, _with_random_b(params, seed=2)), atol=1e-3)
    export_graphdef, exported = merged_state(recipe, params)   # `spillway export`'s merge gives the same model
    np.testing.assert_allclose(logits(export_graphdef, exported), by_hand, atol=2e-5, rtol=1e-5)


def test_an_expert_adapter_is_each_experts_peft_adapter():
    """Token by token: x W_e + (alpha / r) (x A_e^T) B_e^T for the expert e it is routed to, as PEFT computes
    an adapted nn.Linear, equals x times the merged weight the dispatches take."""
    from spillway.layers.lora import ExpertLoraAdapter, LoraSpec

    spec = LoraSpec(rank=2, alpha=6.0, targets=frozenset(), expert_targets=frozenset({("mlp", "w_up")}))
    adapter = ExpertLoraAdapter(3, 5, 4, spec, in_axis=None, out_axis=None, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(1), 3)
    adapter.b.set_value(jax.random.normal(keys[0], (3, 4, 2)))
    w_eio = jax.random.normal(keys[1], (3, 5, 4))
    x_nd, expert_n = jax.random.normal(keys[2], (6, 5)), np.array([0, 2, 1, 2, 0, 1])
    merged = np.asarray(adapter.merged(w_eio))
    a, b = np.asarray(adapter.a.get_value()), np.asarray(adapter.b.get_value())
    for x, e in zip(np.asarray(x_nd), expert_n):
        peft = x @ np.asarray(w_eio[e]) + 3.0 * (x @ a[e].T) @ b[e].T
        np.testing.assert_allclose(x @ merged[e], peft, rtol=1e-5, atol=1e-5)


@pytest.mark.slow   # builds a Mixtral eagerly, three compiles a dispatch: a minute or more on 2 busy cores
@pytest.mark.parametrize("dispatch", sorted(DISPATCHES))
def test_expert_adapters_compute_the_merged_weights_in_every_dispatch(dispatch):
    _expert_lora_logits_match_the_merged_weights(dispatch)


@pytest.mark.slow   # a Mixtral train step sharded over 4 devices and two loss compiles: a minute on 2 busy cores
def test_a_lora_step_on_experts_split_over_devices_trains_their_adapters_only():
    """The experts split over fsdp (dropless gathers them per device): the adapted model's loss is the merged
    model's, and a step changes the adapters only."""
    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.train.batch import Batch
    from spillway.recipes.train.step import make_loss_fn, setup

    recipe = get_recipe("mixtral_tiny", MOE_SMALL + MOE_LORA + ["execution.dtype=float32", "lora.targets=w1,w2,w3"])
    mesh = make_mesh(MeshConfig(1, 4, 1), devices=jax.devices()[:4])
    s = setup(recipe, mesh)
    params = _with_random_b(s.params)
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 128)
    loss = float(jax.jit(make_loss_fn(s.graphdef, mesh=mesh))(params, Batch(tokens)))
    plain = dataclasses.replace(recipe, lora=type(recipe.lora)())
    plain_graphdef = nnx.split(nnx.eval_shape(lambda: plain.build_model(nnx.Rngs(0))))[0]
    merged = _merged_by_hand(jax.device_get(params), recipe.lora.alpha / recipe.lora.rank)
    assert loss == pytest.approx(float(jax.jit(make_loss_fn(plain_graphdef, mesh=mesh))(merged, Batch(tokens))),
                                 rel=1e-5)
    opt_state = jax.jit(s.optimizer.init)(params)
    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}
    new_params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(tokens))   # step 0: lr 0
    new_params, _, _, metrics = s.train_step(new_params, opt_state, None, Batch(tokens))
    after = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(new_params)}
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed and all(any(str(k).startswith("lora_") for k in p) for p in changed), changed
    assert {p[-2] for p in changed} == {"lora_w_gate", "lora_w_up", "lora_w_down"} and np.isfinite(metrics["loss"])


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


def test_a_base_replaced_under_the_adapters_is_refused_a_copy_of_it_is_not(tmp_path):
    """Another model saved at a LoRA run's base path was read without a word by generate, export and a resume
    (the adapters on weights they were not trained with); its digest is kept when the run starts now."""
    import shutil

    from spillway.models.hf import to_hf
    from spillway.recipes.train.checkpoint import CheckpointError
    from spillway.recipes.train.lora_state import check_base_unchanged, check_same_base, pin_base

    def save_base(folder, seed):
        to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(seed)), folder)

    save_base(tmp_path / "base", 0)
    recipe = pin_base(lora_recipe(f"checkpoint.init_from=hf:{tmp_path / 'base'}"))
    assert recipe.checkpoint.init_from_digest is not None
    check_base_unchanged(recipe)   # the same files
    shutil.copytree(tmp_path / "base", tmp_path / "copy")   # a copy elsewhere reads alike
    moved = pin_base(lora_recipe(f"checkpoint.init_from=hf:{tmp_path / 'copy'}"))
    assert moved.checkpoint.init_from_digest == recipe.checkpoint.init_from_digest
    with pytest.raises(ConfigError, match="now names hf:.*copy"):   # the first still there: the digest, which
        check_same_base(moved, recipe.to_json(), "runs/x/checkpoints/2")   # samples files, proves nothing more
    shutil.move(tmp_path / "base", tmp_path / "moved-away")
    check_same_base(moved, recipe.to_json(), "runs/x/checkpoints/2")   # a base moved resumes at its new place
    shutil.move(tmp_path / "moved-away", tmp_path / "base")
    shutil.rmtree(tmp_path / "base")
    save_base(tmp_path / "base", 7)   # another model where the base was
    with pytest.raises(CheckpointError, match=r"base checkpoint.init_from=hf:.*base holds other weights than those "
                                              r"its adapters were trained on"):
        check_base_unchanged(recipe)
    resumed = pin_base(lora_recipe(f"checkpoint.init_from=hf:{tmp_path / 'base'}"))   # a resume's start
    with pytest.raises(CheckpointError, match=r"runs/x/checkpoints/2: the LoRA run's base .* holds other weights"):
        check_same_base(resumed, recipe.to_json(), "runs/x/checkpoints/2")
    saved_before_digests = json.loads(recipe.to_json())
    saved_before_digests["checkpoint"].pop("init_from_digest")
    check_same_base(resumed, json.dumps(saved_before_digests), "runs/x/checkpoints/2")   # not checked


def test_a_run_with_its_base_in_host_memory_exports_merged():
    """offload.params=host with the adapters' state on device (the README's LoRA setup) made the merged export
    fail: the recipe without adapters refused that placement, after the export had begun writing."""
    from spillway.recipes.export import merged_state

    on_host, on_device = lora_recipe("offload.params=host"), lora_recipe()
    params = _with_random_b(nnx.split(on_device.build_model(nnx.Rngs(0)))[1])
    _, merged_on_host = merged_state(on_host, params)
    _, merged_on_device = merged_state(on_device, params)
    for (path, a), (_, b) in zip(nnx.to_flat_state(merged_on_host), nnx.to_flat_state(merged_on_device), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


def test_a_relative_hf_base_is_pinned_by_its_absolute_path(tmp_path, monkeypatch):
    """A LoRA run started with checkpoint.init_from=hf:<relative path> saved that path as named: generate and
    export from another directory looked for the base there. Runs that saved it so still resume."""
    from spillway.models.hf import to_hf
    from spillway.recipes.train.lora_state import check_same_base, pin_base

    to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(0)), tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    pinned = pin_base(lora_recipe("checkpoint.init_from=hf:base"))
    assert pinned.checkpoint.init_from == f"hf:{tmp_path / 'base'}"
    saved_relative = json.loads(pinned.to_json())
    saved_relative["checkpoint"]["init_from"] = "hf:base"   # as a run started before this saved it
    check_same_base(pinned, json.dumps(saved_relative), "runs/x/checkpoints/2")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")   # the same relative path names another folder from here
    with pytest.raises(ConfigError, match=r"trained on checkpoint.init_from=hf:base, but the run now names"):
        check_same_base(pin_base(lora_recipe("checkpoint.init_from=hf:../elsewhere")), json.dumps(saved_relative),
                        "runs/x/checkpoints/2")


def test_the_adapters_share_benchmark_counts_r_times_in_plus_out_per_layer():
    from benchmarks.lora_share import share

    counted = share("tiny", 4, "q_proj,down_proj")   # tiny: 4 layers, d_model 192, 6 heads of 32, MLP 512
    assert counted["adapter_params"] == 4 * 4 * ((192 + 192) + (512 + 192))
    assert counted["adapter_moments_bytes"] == 8 * counted["adapter_params"]


def test_a_lora_runs_header_counts_the_adapters_it_trains():
    from spillway.recipes.train.lora_state import trained_summary

    # SMALL: 2 layers, d_model 32, 4 heads of 8 with 2 KV heads (v_proj out 16): r (in + out) per projection
    expected = 2 * 4 * ((32 + 32) + (32 + 16))
    line = trained_summary(lora_recipe())
    assert line.startswith(f"LoRA rank 4 on q_proj, v_proj: {expected / 1e6:.2f}M adapter parameters trained (")
    share = 100 * expected / lora_recipe().num_params()
    assert f"({share:.2g}% of the model), the base frozen" in line
    assert trained_summary(get_recipe("tiny", SMALL)) == ""


def test_lora_settings_without_a_rank_are_refused_not_ignored():
    """`--set lora.targets=...` without lora.rank trained every weight, the targets unused, without a word."""
    with pytest.raises(ConfigError, match=r"--set lora.targets=q_proj lora.alpha=16: lora.rank is 0, so LoRA is "
                                          r"off .*--set lora.rank=16"):
        get_recipe("tiny", ["lora.targets=q_proj", "lora.alpha=16", "model.num_layers=3"])
    assert not get_recipe("tiny", ["lora.rank=0", "lora.alpha=16"]).lora.enabled   # turned off on purpose
    assert get_recipe("tiny", ["lora.rank=4", "lora.alpha=16", "checkpoint.init_from=/x"]).lora.alpha == 16


def test_generate_and_export_find_the_base_where_the_project_tree_moved(tmp_path):
    """A LoRA run pins its base by an absolute path: with the project folder moved (another disk, a copy on
    another machine), generate and export found no base. They now look where the base was relative to the run
    folder, and take it there when it holds the same files."""
    import shutil

    from spillway.models.hf import to_hf
    from spillway.recipes.train.lora_state import base_where_the_run_went, pin_base

    project = tmp_path / "project"
    to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(0)), project / "bases" / "tiny")
    pinned = pin_base(lora_recipe(f"checkpoint.init_from=hf:{project / 'bases' / 'tiny'}",
                                  f"checkpoint.dir={project / 'runs' / 'lora'}"))
    assert pinned.checkpoint.init_from_relative == "../../bases/tiny"
    step = project / "runs" / "lora" / "checkpoints" / "2"
    assert base_where_the_run_went(pinned, step) == pinned   # the base where it was pinned: as it is
    shutil.move(project, tmp_path / "moved")
    found = base_where_the_run_went(pinned, tmp_path / "moved" / "runs" / "lora" / "checkpoints" / "2")
    assert found.checkpoint.init_from == f"hf:{tmp_path / 'moved' / 'bases' / 'tiny'}"
    assert found.checkpoint.init_from_digest == pinned.checkpoint.init_from_digest
    shutil.rmtree(tmp_path / "moved" / "bases" / "tiny")   # other weights at that place: not taken
    to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(7)), tmp_path / "moved" / "bases" / "tiny")
    assert base_where_the_run_went(pinned, tmp_path / "moved" / "runs" / "lora" / "checkpoints" / "2") == pinned
    assert base_where_the_run_went(pinned, tmp_path / "elsewhere" / "2") == pinned   # a step outside a run


def test_the_bases_relative_place_is_read_between_real_paths(tmp_path):
    """A project folder reached through a symlink: the run named by the link, the base resolved, gave a
    relative path out of the project (../../../real/...), which named nothing once the project moved."""
    from spillway.models.hf import to_hf
    from spillway.recipes.train.lora_state import pin_base

    to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(0)), tmp_path / "real" / "bases" / "tiny")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    pinned = pin_base(lora_recipe(f"checkpoint.init_from=hf:{tmp_path / 'real' / 'bases' / 'tiny'}",
                                  f"checkpoint.dir={tmp_path / 'link' / 'runs' / 'lora'}"))
    assert pinned.checkpoint.init_from_relative == "../../bases/tiny"


def test_the_base_digest_reads_every_tensor_of_a_safetensors_base(tmp_path):
    """Another model at the base's path whose differences lay in none of the three 64 KiB file windows (a
    fine-tune merged into a few projections) had the same digest: every tensor's data is now read at its start
    and end. A digest kept before (legacy) is still compared by its own reads."""
    from safetensors.numpy import save_file

    from spillway.recipes.train.base_digest import _digest, base_digest, holds_digest

    tensors = {f"layer{k}.weight": np.full((512, 512), k, np.float32) for k in range(8)}   # 1 MiB each
    for name, folder in (("base", tmp_path / "base"), ("other", tmp_path / "other")):
        folder.mkdir()
        changed = dict(tensors, **({"layer1.weight": tensors["layer1.weight"] * 1.01} if name == "other" else {}))
        save_file(changed, str(folder / "model.safetensors"))
        (folder / "config.json").write_text("{}")
    legacy = _digest(tmp_path / "base", per_tensor=False)
    assert legacy == _digest(tmp_path / "other", per_tensor=False)   # what the file windows alone saw
    assert base_digest(tmp_path / "base") != base_digest(tmp_path / "other")
    assert holds_digest(tmp_path / "base", base_digest(tmp_path / "base"))
    assert not holds_digest(tmp_path / "other", base_digest(tmp_path / "base"))
    assert holds_digest(tmp_path / "base", legacy)   # a run that kept a legacy digest still resumes


def test_the_base_digest_leaves_out_mistrals_own_files_the_load_never_reads(tmp_path):
    """Mistral's repositories hold consolidated.safetensors beside transformers' shards; the load reads the shards
    alone, so deleting that copy (or downloading it later) changes nothing the adapters stand on, and was refused
    as other weights. A digest kept with it before ("v2:") is still compared by its own reads."""
    from safetensors.numpy import save_file

    from spillway.recipes.train.base_digest import PER_TENSOR, _digest, base_digest, holds_digest

    base = tmp_path / "base"
    base.mkdir()
    save_file({"model.embed_tokens.weight": np.ones((8, 4), np.float32)}, str(base / "model.safetensors"))
    save_file({"tok_embeddings.weight": np.ones((8, 4), np.float32)}, str(base / "consolidated.safetensors"))
    (base / "config.json").write_text("{}")
    kept, kept_before = base_digest(base), PER_TENSOR + _digest(base, per_tensor=True)
    assert holds_digest(base, kept) and holds_digest(base, kept_before)
    (base / "consolidated.safetensors").unlink()
    assert holds_digest(base, kept)
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), np.float32)}, str(base / "model.safetensors"))
    assert not holds_digest(base, kept)   # the weights it reads still count
    assert not holds_digest(base, kept_before)   # compared as taken: with the file it had


def test_a_run_that_kept_a_legacy_base_digest_resumes_on_the_same_base_only(tmp_path):
    from spillway.models.hf import to_hf
    from spillway.recipes.train.base_digest import _digest
    from spillway.recipes.train.checkpoint import CheckpointError
    from spillway.recipes.train.lora_state import check_same_base, pin_base

    to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(0)), tmp_path / "base")
    recipe = pin_base(lora_recipe(f"checkpoint.init_from=hf:{tmp_path / 'base'}"))
    saved = json.loads(recipe.to_json())
    saved["checkpoint"]["init_from_digest"] = _digest(tmp_path / "base", per_tensor=False)   # as kept before
    check_same_base(recipe, json.dumps(saved), "runs/x/checkpoints/2")
    to_hf(get_recipe("tiny", SMALL).build_model(nnx.Rngs(7)), tmp_path / "base")   # other weights there
    with pytest.raises(CheckpointError, match="holds other weights"):
        check_same_base(pin_base(lora_recipe(f"checkpoint.init_from=hf:{tmp_path / 'base'}")), json.dumps(saved),
                        "runs/x/checkpoints/2")
