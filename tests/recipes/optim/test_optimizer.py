"""recipes/optim/optimizer.py against plain optax, on CPU.

The reference is the chain the optimizer promises to equal:
optax.chain(clip_by_global_norm, adamw(schedule, mask=decay)). The device path,
the streamed host path and the host-compute path must all track it for 20
jitted steps. CPU lowers memory-kind moves to no-ops, so these tests prove the
maths and the placement bookkeeping (memory kinds, shardings, checkpoints);
the HBM saving itself is measured by benchmarks/optimizer_state_toy.py.
"""

from __future__ import annotations

import dataclasses

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spillway.recipes.optim import host_memory, host_streaming, layouts as layouts_lib, optimizer as optimizer_lib
from spillway.recipes.optim import schedule as schedule_lib
from spillway.recipes.optim.config import OptimizerConfig
from spillway.recipes.optim.layouts import LeafLayout
from spillway.recipes.optim.optimizer import Optimizer, OptState

LAYERS = 4
STEPS = 20


def toy_params(dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": (0.02 * jax.random.normal(k[0], (32, 8))).astype(dtype),
        "blocks": {
            "w": (0.1 * jax.random.normal(k[1], (LAYERS, 8, 16))).astype(dtype),
            "norm": (1.0 + 0.1 * jax.random.normal(k[2], (LAYERS, 16))).astype(dtype),
        },
        "head": (0.1 * jax.random.normal(k[3], (8, 32))).astype(dtype),
    }


DECAY = {"embed": False, "blocks": {"w": True, "norm": False}, "head": True}
STACKED = {"embed": False, "blocks": {"w": True, "norm": True}, "head": False}
# Non-stacked leaves stream along their vocabulary axis (as make_layouts picks for a Llama).
STREAM_AXIS = {"embed": 0, "blocks": {"w": None, "norm": None}, "head": 1}
# With this piece size the embedding and head go in 4 pieces each.
SMALL_PIECES = 64
# A schedule longer than OptimizerConfig()'s default warmup, for tests that do not look at it.
LONG_SCHEDULE = 1000


def toy_layouts(memory: str, master: bool):
    return jax.tree.map(lambda s, d, a: LeafLayout(stacked=s, state_memory=memory, decay=d, master=master,
                                                   stream_axis=a),
                        STACKED, DECAY, STREAM_AXIS)


def toy_grads(params, step, scale):
    keys = jax.random.split(jax.random.key(1000 + step), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([(scale * jax.random.normal(k, p.shape)).astype(p.dtype)
                              for k, p in zip(keys, leaves)])


def reference_chain(cfg: OptimizerConfig):
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm is not None else optax.identity(),
        optax.adamw(schedule_lib.make_schedule(cfg, STEPS), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=DECAY))


def host_leaves(opt_state, layouts):
    """(name, array) for every state array whose parameter has host-resident state."""
    flat_layouts = jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, LeafLayout))
    out = []
    for name in ("mu", "nu", "master"):
        tree = getattr(opt_state, name)
        for layout, leaf in zip(flat_layouts, jax.tree.structure(STACKED).flatten_up_to(tree)):
            if layout.state_memory == "host" and leaf is not None:
                # a streamed stacked leaf's state is two arrays (LayerHalves)
                out += [(name, array) for array in jax.tree.leaves(leaf)]
    return out


def run_against_optax(cfg: OptimizerConfig, memory: str, param_dtype, grad_scale: float,
                      stream_prefetch: bool = True, piece_elements: int = host_streaming.PIECE_ELEMENTS):
    """20 jitted steps of our optimizer and of the optax chain (on fp32 masters); returns both.

    Our state comes back in saved form (`Optimizer.saved_form`: streamed
    stacked leaves' LayerHalves joined), leaf for leaf comparable with optax's.
    """
    params = toy_params(param_dtype)
    master_ref = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    layouts = toy_layouts(memory, master=param_dtype != jnp.float32 and cfg.master_weights)
    opt = Optimizer(cfg, layouts, total_steps=STEPS, stream_prefetch=stream_prefetch,
                    stream_piece_elements=piece_elements)
    tx = reference_chain(cfg)
    opt_state, ref_state = opt.init(params), tx.init(master_ref)
    for _, leaf in host_leaves(opt_state, layouts):
        assert leaf.sharding.memory_kind == "pinned_host"

    step = jax.jit(opt.update)

    @jax.jit
    def ref_step(grads, state, master):
        updates, state = tx.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), state, master)
        return optax.apply_updates(master, updates), state, optax.tree.norm(grads)

    norms = []
    for i in range(STEPS):
        grads = toy_grads(params, i, grad_scale)
        params, opt_state, stats = step(grads, opt_state, params)
        master_ref, ref_state, ref_norm = ref_step(grads, ref_state, master_ref)
        norms.append((float(stats["grad_norm"]), float(ref_norm)))
    # Compared in the form checkpoints hold: one array per state leaf, as optax keeps it.
    return params, opt.saved_form(opt_state), master_ref, ref_state, layouts, norms


def assert_tree_close(actual, expected, rtol=1e-6, atol=1e-7):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol)


WHOLE = host_streaming.PIECE_ELEMENTS   # the toy's embedding and head fit one piece
CASES = {
    # name: (state_memory, update_on_host, grad_scale, clip_norm, stream_prefetch, piece_elements)
    "device_clipped": ("device", False, 10.0, 1.0, True, WHOLE),
    "host_streamed_clipped": ("host", False, 10.0, 1.0, True, WHOLE),
    "host_streamed_unclipped": ("host", False, 0.01, None, True, WHOLE),
    "host_streamed_no_prefetch": ("host", False, 10.0, 1.0, False, WHOLE),
    "host_embed_head_in_pieces": ("host", False, 10.0, 1.0, True, SMALL_PIECES),
    "host_embed_head_in_pieces_no_prefetch": ("host", False, 10.0, 1.0, False, SMALL_PIECES),
    "host_compute_on": ("host", True, 10.0, 1.0, True, WHOLE),
}


# The two switches each have their case; both at once (a piece-wise embedding without prefetch) runs with the
# slow tests.
SLOW_CASES = {"host_embed_head_in_pieces_no_prefetch"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_fp32_params_match_optax(case):
    memory, on_host, scale, clip, prefetch, piece_elements = CASES[case]
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=5, update_on_host=on_host, clip_norm=clip)
    params, opt_state, ref_params, ref_state, layouts, norms = run_against_optax(
        cfg, memory, jnp.float32, scale, prefetch, piece_elements)
    if clip is not None:
        assert all(ours > clip for ours, _ in norms), "grad scale should make clipping active"
    np.testing.assert_allclose(*zip(*norms), rtol=1e-6)
    assert_tree_close(params, ref_params)
    adam = ref_state[1][0]
    assert_tree_close(opt_state.mu, adam.mu)
    assert_tree_close(opt_state.nu, adam.nu)
    assert int(opt_state.count) == STEPS
    assert jax.tree.leaves(opt_state.master) == []
    for name, leaf in host_leaves(opt_state, layouts):
        assert leaf.sharding.memory_kind == "pinned_host", name
    if memory == "host":
        assert len(host_leaves(opt_state, layouts)) == 8


# The embedding and head in pieces with a master copy: as the float32 pieces case, with the slow tests.
@pytest.mark.parametrize("memory,on_host,piece_elements", [
    ("device", False, WHOLE), ("host", False, WHOLE),
    pytest.param("host", False, SMALL_PIECES, marks=pytest.mark.slow), ("host", True, WHOLE)])
def test_bf16_params_with_master_weights_match_optax_on_fp32_masters(memory, on_host, piece_elements):
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=5, update_on_host=on_host)
    params, opt_state, ref_master, _, layouts, _ = run_against_optax(cfg, memory, jnp.bfloat16, 10.0,
                                                                     piece_elements=piece_elements)
    assert_tree_close(opt_state.master, ref_master)
    for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(ref_master)):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p, np.float32),
                                      np.asarray(m.astype(jnp.bfloat16), np.float32))
    if memory == "host":
        kinds = {name: leaf.sharding.memory_kind for name, leaf in host_leaves(opt_state, layouts)}
        assert set(kinds) == {"mu", "nu", "master"} and set(kinds.values()) == {"pinned_host"}


def test_weight_decay_mask_is_respected():
    """With zero gradients only weight decay moves parameters: exactly the decayed leaves shrink."""
    cfg = OptimizerConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5)
    params = toy_params()
    opt = Optimizer(cfg, toy_layouts("host", master=False), total_steps=10)
    grads = jax.tree.map(jnp.zeros_like, params)
    new_params, _, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    for decayed, old, new in zip(jax.tree.leaves(DECAY), jax.tree.leaves(params), jax.tree.leaves(new_params)):
        if decayed:
            np.testing.assert_allclose(np.asarray(new), np.asarray(old) * (1 - 0.1 * 0.5), rtol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def test_mixed_placement_and_bf16_grads():
    """Host blocks, device embedding/head; bf16 grads on fp32 params equal optax on the upcast grads."""
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=2)
    layouts = jax.tree.map(lambda s, d: LeafLayout(s, "host" if s else "device", d), STACKED, DECAY)
    opt, tx = Optimizer(cfg, layouts, total_steps=STEPS), reference_chain(cfg)
    params = ref = toy_params()
    state, ref_state = opt.init(params), tx.init(ref)
    assert state.mu["blocks"]["w"].first.sharding.memory_kind == "pinned_host"   # LayerHalves
    assert state.mu["embed"].sharding.memory_kind == "device"
    step = jax.jit(opt.update)

    @jax.jit
    def ref_step(grads, ref_state, ref):
        updates, ref_state = tx.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, ref)
        return optax.apply_updates(ref, updates), ref_state

    for i in range(3):
        grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), toy_grads(params, i, 5.0))
        params, state, _ = step(grads, state, params)
        ref, ref_state = ref_step(grads, ref_state, ref)
    assert_tree_close(params, ref)


def test_schedule_warmup_then_cosine_to_min_ratio():
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    schedule = schedule_lib.make_schedule(cfg, 110)
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10), schedule(60), schedule(110)],
                               [0.0, 0.5, 1.0, 0.55, 0.1], rtol=1e-6, atol=1e-7)


# --- placement: FSDP shardings, checkpoints ------------------------------------

def fsdp_specs():
    return {"embed": P("fsdp", None), "blocks": {"w": P(None, "fsdp", None), "norm": P(None, None)},
            "head": P("fsdp", None)}


def test_state_shares_param_fsdp_sharding_on_8_devices():
    assert len(jax.devices()) >= 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "fsdp"))
    param_sh = jax.tree.map(lambda spec: NamedSharding(mesh, spec), fsdp_specs())
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=2)
    layouts = jax.tree.map(lambda s, d, a: LeafLayout(s, "device" if s is False and d is False else "host", d,
                                                      stream_axis=a),
                           STACKED, DECAY, STREAM_AXIS)  # the embedding's state stays on device, the rest on host
    # The head (sharded over fsdp on axis 0) streams in pieces along its unsharded axis 1.
    opt, tx = Optimizer(cfg, layouts, total_steps=STEPS, stream_piece_elements=SMALL_PIECES), reference_chain(cfg)
    state_sh = opt.state_shardings(param_sh)
    params = jax.device_put(toy_params(), param_sh)
    state = jax.jit(opt.init, out_shardings=state_sh)(params)
    eager_state = opt.init(params)  # outside jit: must land in the same shardings
    assert jax.tree.map(lambda x: x.sharding, eager_state) == jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(opt.update, in_shardings=(param_sh, state_sh, param_sh),
                   out_shardings=(param_sh, state_sh, None))
    ref, ref_state = toy_params(), tx.init(toy_params())
    for i in range(3):
        grads = jax.device_put(toy_grads(params, i, 10.0), param_sh)
        params, state, _ = step(grads, state, params)
        updates, ref_state = tx.update(toy_grads(ref, i, 10.0), ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    assert_tree_close(params, ref)
    flat_layouts = jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, LeafLayout))
    saved = opt.saved_form(state)   # LayerHalves joined: one array per parameter, in its sharding
    assert [x.sharding for x in jax.tree.leaves(state.mu["blocks"]["w"])] == [saved.mu["blocks"]["w"].sharding] * 2
    for tree in (saved.mu, saved.nu):
        for layout, spec, leaf in zip(flat_layouts, jax.tree.leaves(fsdp_specs()), jax.tree.leaves(tree)):
            assert leaf.sharding.mesh.shape == mesh.shape
            assert leaf.sharding.spec == spec
            assert leaf.sharding.memory_kind == ("pinned_host" if layout.state_memory == "host" else "device")


def test_orbax_roundtrip_keeps_host_state_in_pinned_host(tmp_path):
    import orbax.checkpoint as ocp   # a hard dependency: missing, this test fails
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    param_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), STACKED)
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)
    opt = Optimizer(cfg, toy_layouts("host", master=True), total_steps=STEPS)
    params = jax.device_put(toy_params(jnp.bfloat16), param_sh)
    state = opt.init(params)
    params, state, _ = jax.jit(opt.update)(toy_grads(params, 0, 1.0), state, params)

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "opt_state", opt.saved_form(state))   # as the train loop saves it
    checkpointer.wait_until_finished()
    restored = opt.from_saved_form(
        checkpointer.restore(tmp_path / "opt_state", opt.saved_abstract_state(params, param_sh)))
    assert jax.tree.structure(restored) == jax.tree.structure(state)

    assert isinstance(restored, OptState)
    for name in ("mu", "nu", "master"):
        for got, want in zip(jax.tree.leaves(getattr(restored, name)), jax.tree.leaves(getattr(state, name))):
            assert got.sharding.memory_kind == "pinned_host"
            # compare on NumPy copies: one op over host and device arrays is an error
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(restored.count) == 1



# One layer (an empty second half) and three (halves of 2 and 1) with and without prefetch; five with the slow
# tests.
@pytest.mark.parametrize("layers,prefetch", [(1, True), (3, True), (1, False), (3, False),
                                             pytest.param(5, True, marks=pytest.mark.slow),
                                             pytest.param(5, False, marks=pytest.mark.slow)])
def test_odd_layer_counts_stream_through_both_halves(layers, prefetch, monkeypatch):
    """Odd stacks give halves of unequal length (and a one-layer stack an empty second half)."""
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", layers)
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=5)
    params, saved, ref_params, ref_state, _, _ = run_against_optax(cfg, "host", jnp.float32, 10.0, prefetch)
    assert_tree_close(params, ref_params)
    assert_tree_close(saved.mu, ref_state[1][0].mu)
    assert saved.mu["blocks"]["w"].shape == (layers, 8, 16)


def test_saved_form_is_placement_independent_and_round_trips():
    """Host state streamed in two halves saves exactly like state on device, and splits back."""
    params = toy_params(jnp.bfloat16)
    grads = toy_grads(params, 0, 1.0)
    states = {}
    for memory in ("device", "host"):
        cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)
        opt = Optimizer(cfg, toy_layouts(memory, master=True), total_steps=STEPS)
        _, state, _ = jax.jit(opt.update)(grads, opt.init(params), params)
        states[memory] = (opt, state)
    host_opt, host_state = states["host"]
    assert isinstance(host_state.mu["blocks"]["w"], host_streaming.LayerHalves)
    assert host_state.mu["blocks"]["w"].first.shape == (2, 8, 16)
    saved = host_opt.saved_form(host_state)
    device_saved = states["device"][0].saved_form(states["device"][1])
    assert jax.tree.structure(saved) == jax.tree.structure(device_saved)
    assert_tree_close(saved, device_saved)
    for _, leaf in host_leaves(saved, toy_layouts("host", True)):
        assert leaf.sharding.memory_kind == "pinned_host"
    abstract = host_opt.saved_abstract_state(params)
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape, saved)
    back = host_opt.from_saved_form(saved)
    assert jax.tree.structure(back) == jax.tree.structure(host_state)
    assert_tree_close(back, host_state, rtol=0, atol=0)


# --- layouts from nnx metadata ---------------------------------------------------

def test_make_layouts_reads_nnx_metadata_and_runs_on_state():
    from flax import nnx

    from spillway.layers import names

    class Toy(nnx.Module):
        def __init__(self):
            self.embed = nnx.Param(jnp.ones((32, 8), jnp.bfloat16), logical_axes=(names.VOCAB, names.EMBED))
            self.w = nnx.Param(jnp.ones((LAYERS, 8, 16), jnp.bfloat16),
                               logical_axes=(names.LAYERS, names.EMBED, names.MLP))
            self.norm = nnx.Param(jnp.ones((LAYERS, 16), jnp.float32), logical_axes=(names.LAYERS, names.NORM),
                                  optimizer_memory="device")

    cfg = OptimizerConfig()
    state = nnx.state(Toy(), nnx.Param)
    layouts = layouts_lib.make_layouts(state, cfg, state_memory="host")
    assert layouts["embed"] == LeafLayout(stacked=False, state_memory="host", decay=False, master=True,
                                          stream_axis=0)
    assert layouts["w"] == LeafLayout(stacked=True, state_memory="host", decay=True, master=True)
    assert layouts["norm"] == LeafLayout(stacked=True, state_memory="device", decay=False, master=False)

    opt = Optimizer(cfg, layouts, total_steps=LONG_SCHEDULE)
    opt_state = opt.init(state)
    assert opt_state.master["w"].get_value().first.sharding.memory_kind == "pinned_host"   # LayerHalves
    assert opt.saved_form(opt_state).master["w"].get_value().shape == (LAYERS, 8, 16)
    grads = jax.tree.map(jnp.ones_like, state)
    new_state, _, stats = jax.jit(opt.update)(grads, opt_state, state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert float(stats["learning_rate"]) == 0.0  # warmup starts at zero


def random_like(tree, seed: int):
    """Normal values (numpy's generator: compiling jax.random for many leaves costs seconds each) with the
    shapes and dtypes of `tree`'s leaves (arrays or ShapeDtypeStructs)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), tree)


def test_decay_follows_parameter_metadata_on_a_model_with_qkv_biases():
    """q/k/v biases are [heads, head_dim]: the rank rule alone would decay them; the layers' metadata says no."""
    from flax import nnx

    from spillway.layers.block import BlockConfig
    from spillway.models.decoder import DecoderLM, DecoderSpec

    @dataclasses.dataclass(frozen=True)
    class QwenLike:   # q/k/v biases and q/k norms, untied head
        def decoder_spec(self, execution):
            return DecoderSpec(vocab_size=48, num_layers=2, max_seq_len=16, block=BlockConfig(
                d_model=16, num_heads=4, num_kv_heads=2, mlp_hidden=24, qkv_bias=True, qk_norm=True,
                execution=execution))

    # Built abstractly (an eager build costs tens of seconds of op dispatch), then filled with random values.
    abstract = nnx.state(nnx.eval_shape(lambda: DecoderLM(QwenLike(), rngs=nnx.Rngs(0), remat="save_all")), nnx.Param)
    state = random_like(abstract, 0)
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.5)
    layouts = layouts_lib.make_layouts(state, cfg)

    is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731
    decay = {jax.tree_util.keystr(path): layout.decay
             for path, layout in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]}
    not_decayed = {"bq", "bk", "bv", "scale", "table"}   # biases, every norm, the embedding
    expected = {path: path.split("'")[-2] not in not_decayed for path in decay}
    assert decay == expected
    assert sum(expected.values()) == 8   # wq, wk, wv, wo, w_gate, w_up, w_down, head
    bq = state["layers"]["blocks"]["attn"]["bq"]
    assert layouts_lib.rank_decay(bq.get_metadata()["logical_axes"], bq.get_value().shape, True), \
        "the 2-D bias would be decayed by shape alone: this test would not see the metadata"

    # The same mask in plain optax gives the same parameters (and the decay is strong enough to matter).
    mask = [layout.decay for layout in jax.tree.leaves(layouts, is_leaf=is_layout)]
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule_lib.make_schedule(cfg, STEPS), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, mask=mask))
    opt = Optimizer(cfg, layouts, total_steps=STEPS)

    @jax.jit
    def both_steps(grads, params, opt_state, ref_params, ref_state):
        params, opt_state, _ = opt.update(grads, opt_state, params)
        updates, ref_state = tx.update(jax.tree.leaves(grads), ref_state, ref_params)
        return params, opt_state, optax.apply_updates(ref_params, updates), ref_state

    params, ref_params = state, jax.tree.leaves(state)
    opt_state, ref_state = opt.init(params), tx.init(ref_params)
    for i in range(5):
        grads = random_like(params, i + 1)
        params, opt_state, ref_params, ref_state = both_steps(grads, params, opt_state, ref_params, ref_state)
    assert_tree_close(jax.tree.leaves(params), ref_params, rtol=1e-5, atol=1e-6)


# --- bad input --------------------------------------------------------------------

def test_bad_state_memory_is_rejected():
    with pytest.raises(ValueError, match="state_memory"):
        layouts_lib.make_layouts({"w": jnp.ones((2, 2))}, OptimizerConfig(), state_memory="hbm")
    with pytest.raises(ValueError, match="state_memory"):
        LeafLayout(stacked=False, state_memory="cpu", decay=True)


def test_host_state_without_pinned_host_memory_is_rejected(monkeypatch):
    assert host_memory.host_memory_available()  # CPU JAX exposes pinned_host
    monkeypatch.setattr(optimizer_lib, "host_memory_available", lambda device=None: False)
    with pytest.raises(ValueError, match="pinned_host"):
        Optimizer(OptimizerConfig(), toy_layouts("host", master=False), total_steps=LONG_SCHEDULE)
    # Device state needs nothing.
    Optimizer(OptimizerConfig(), toy_layouts("device", master=False), total_steps=LONG_SCHEDULE)


def test_check_host_memory():
    host_memory.check_host_memory(2**30, host_ram_bytes=2**31)
    with pytest.raises(host_memory.HostMemoryError, match="GiB"):
        host_memory.check_host_memory(2**31 + 1, host_ram_bytes=2**31)
    host_memory.check_host_memory(1)  # default: /proc/meminfo
    with pytest.raises(host_memory.HostMemoryError):
        host_memory.check_host_memory(2**62)


def test_host_bytes_counts_pinned_state():
    cfg = OptimizerConfig()
    opt = Optimizer(cfg, toy_layouts("host", master=True), total_steps=LONG_SCHEDULE)
    params = toy_params(jnp.bfloat16)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    # before init allocates anything, from shapes and shardings alone
    assert opt.host_bytes(opt.abstract_state(params)) == 3 * 4 * n_params  # mu, nu, master in fp32
    assert opt.host_bytes(opt.init(params)) == 3 * 4 * n_params


def test_layout_and_dtype_mismatches_are_rejected():
    cfg = OptimizerConfig()
    with pytest.raises(ValueError, match="do not match the layout tree"):
        Optimizer(cfg, toy_layouts("device", master=False),
                  total_steps=LONG_SCHEDULE).init({"embed": jnp.ones((32, 8))})
    with pytest.raises(ValueError, match="master=False"):
        Optimizer(cfg, toy_layouts("device", master=False), total_steps=LONG_SCHEDULE).init(toy_params(jnp.bfloat16))
    with pytest.raises(ValueError, match="master_weights is False"):
        Optimizer(dataclasses.replace(cfg, master_weights=False), toy_layouts("device", master=True),
                  total_steps=LONG_SCHEDULE)
    with pytest.raises(ValueError, match="clip_norm"):
        OptimizerConfig(clip_norm=0.0)


@pytest.mark.parametrize("field,value,message", [
    ("learning_rate", 0.0, "optimizer.learning_rate must be a positive finite number"),
    ("learning_rate", -1e-3, "optimizer.learning_rate must be a positive finite number"),
    ("eps", 0.0, "optimizer.eps must be a positive finite number"),
    ("warmup_steps", -1, "optimizer.warmup_steps must be zero or positive"),
    ("weight_decay", -0.1, "optimizer.weight_decay must be zero or positive"),
    ("b1", 1.0, r"optimizer.b1 must be in \[0, 1\)"),
    ("b2", -0.5, r"optimizer.b2 must be in \[0, 1\)"),
    ("min_lr_ratio", 1.5, r"optimizer.min_lr_ratio must be in \[0, 1\]"),
])
def test_hyperparameters_that_cannot_work_are_config_errors(field, value, message):
    from spillway.layers.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**{field: value})


def test_schedule_needs_steps_past_the_warmup():
    with pytest.raises(ValueError, match=r"warmup_steps \(10\) must be fewer than the schedule's 10 steps"):
        schedule_lib.make_schedule(OptimizerConfig(warmup_steps=10), 10)
    with pytest.raises(ValueError, match="total_steps must be a positive integer"):
        Optimizer(OptimizerConfig(), toy_layouts("device", master=False), total_steps=0)


# --- streaming pieces of non-stacked leaves ---------------------------------------

def test_piece_rows_is_the_largest_divisor_under_the_limit():
    from spillway.recipes.optim.host_streaming import piece_rows
    assert piece_rows((128256, 4096), 0, 1 << 26) == 16032            # 8 pieces of 250 MiB (fp32)
    assert piece_rows((4096, 128256), 1, 1 << 26) == 16032
    assert piece_rows((32, 8), 0, 64) == 8
    assert piece_rows((7, 100), 0, 10) == 1                           # one row even above the limit
    assert piece_rows((4096,), 0, 1 << 26) == 4096                    # small: one piece


def test_stream_axis_avoids_the_fsdp_sharded_axis():
    from spillway.layers import names
    assert layouts_lib._stream_axis((names.VOCAB, names.EMBED), (128256, 4096)) == 0
    assert layouts_lib._stream_axis((names.EMBED, names.VOCAB), (4096, 128256)) == 1
    assert layouts_lib._stream_axis((names.NORM,), (4096,)) is None
    assert layouts_lib._stream_axis(None, (8, 32)) == 1                   # no metadata: the longest axis


def test_stream_update_rejects_pieces_that_do_not_divide():
    from spillway.recipes.optim.host_streaming import stream_update
    x = jnp.ones((6, 4))
    with pytest.raises(ValueError, match="piece 4 must divide the axis length 6"):
        stream_update([lambda g, p, s: (p, s)], [x], [x], [(x,)], axis=0, piece=4)
