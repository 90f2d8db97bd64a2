"""The planner's FLOP count (models/flops.py) against XLA's own count of the same program.

The oracle is `cost_analysis()["flops"]` of the train step's forward and
backward (`jax.value_and_grad` of the real loss) compiled for the CPU: XLA
counts the products of the optimised program, independently of flops.py.
Two facts shape the setup:

* cost_analysis counts a while loop's body once, whatever its trip count. A
  model of two layers therefore reads as one layer (the scans over the layers
  are while loops), and flops.py is asked for one layer. Not one layer itself:
  a scan of length one is inlined, and CSE then merges the remat recompute
  into the forward pass, so the compiled program recomputes nothing.
* the flash kernel loops over blocks with while loops too; with one block
  (flash_block_size = the sequence) each loop runs once and is counted right,
  and the kernel computes the whole [t, t] block, masked half included, which
  is what flash_attention_pairs counts.

What flops.py leaves out (norms, RoPE, softmax, SiLU, the loss) is about 1%
here: totals agree within 2%, and the recompute of each offload preset (the
step's FLOPs minus those of the same step without remat) within 1% of the
step. Each compile takes 10-60 s on the project's shared 2-core machine, so
the default suite compiles the flash step twice (no remat, full recompute)
and the tests marked slow do dense attention and every other preset.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.execution import Execution
from spillway.layers.offload import PRESETS, OffloadPolicy
from spillway.models import flops
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config
from spillway.recipes.train.step import make_loss_fn
from spillway.recipes.train.batch import Batch

BATCH, SEQ = 2, 128
SIZES = dict(vocab_size=512, d_model=256, num_heads=4, num_kv_heads=2, mlp_hidden=768, max_seq_len=256)


def execution(impl: str) -> Execution:
    return Execution(dtype="float32", attention_impl=impl, flash_block_size=SEQ)


@functools.cache
def xla_step_flops(impl: str, remat: str) -> float:
    """XLA's FLOPs for value_and_grad of the loss of a two-layer Llama: one layer's worth (module docstring)."""
    cfg = preset_config("llama", "tiny", num_layers=2, **SIZES)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, execution(impl), rngs=nnx.Rngs(0),
                                                               remat=remat)))
    tokens = Batch(tokens=jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32))
    compiled = jax.jit(jax.value_and_grad(make_loss_fn(graphdef))).lower(params, tokens).compile()
    return compiled.cost_analysis()["flops"]


def counted(impl: str, remat: str) -> flops.StepFlops:
    spec = preset_config("llama", "tiny", num_layers=1, **SIZES).decoder_spec(execution(impl))
    return flops.train_step_flops(spec, BATCH, SEQ, remat=remat)


def check_against_xla(impl: str, remat: str) -> None:
    ours, theirs = counted(impl, remat), xla_step_flops(impl, remat)
    assert theirs == pytest.approx(ours.total, rel=0.02), (impl, remat, theirs, ours)
    recompute_xla = theirs - xla_step_flops(impl, "save_all")
    assert abs(recompute_xla - ours.recompute) <= 0.01 * ours.total, (impl, remat, recompute_xla, ours.recompute)


@pytest.mark.parametrize("impl", ["flash", pytest.param("xla", marks=pytest.mark.slow)])
def test_forward_backward_and_full_recompute_match_xla(impl):
    """Dense attention (every pair) and the flash kernel with its custom backward pass, without remat and
    with every block recomputed in the backward pass."""
    no_remat = counted(impl, "save_all")
    assert no_remat.recompute == 0
    if impl == "flash":   # the kernel's backward re-runs the scores: one product more than 2x forward
        spec = preset_config("llama", "tiny", num_layers=1, **SIZES).decoder_spec(execution(impl))
        layer = flops.layer_flops(spec, BATCH, SEQ, attention="flash")
        assert no_remat.backward == pytest.approx(2 * no_remat.forward + layer.attn_scores)
        assert layer.attn_scores == 2.0 * BATCH * SEQ * SEQ * 4 * 64   # one block: all t^2 pairs, 4 heads of 64
    check_against_xla(impl, "save_all")
    check_against_xla(impl, "recompute_all")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "flash"])
@pytest.mark.parametrize("remat", sorted(set(PRESETS) - {"save_all", "recompute_all"}))
def test_each_preset_recomputes_what_xla_recomputes(impl, remat):
    check_against_xla(impl, remat)


@pytest.mark.parametrize("seq_len,block,window", [
    (128, 128, None), (512, 128, None), (500, 128, None), (100, 128, None), (1024, 256, 300), (777, 64, 100),
    (256, 64, 64), (256, 64, 1),
])
def test_flash_pairs_are_the_blocks_the_kernel_visits(seq_len, block, window):
    """flash_attention_pairs against the kernel's own block plan (its layout and visited ranges)."""
    from spillway.layers import flash_attention as kernel

    q = jnp.zeros((1, seq_len, 1, 2), jnp.float32)
    cfg = kernel._check_inputs(q, q, q, True, window, block, block, None, None)   # no scale, no soft-cap
    layout = kernel._layout(cfg, q, q, q, None, None, None)   # the window is static here (in cfg)
    visited = 0
    for i in range(layout.num_q_blocks):
        lo, hi = kernel._visited_range(layout.visit_ij[i])
        visited += int(hi) - int(lo)
    assert flops.flash_attention_pairs(seq_len, block, sliding_window=window) == visited * cfg.block_q * cfg.block_k
    # Never fewer than the pairs the mask lets through, never more than all pairs of the padded blocks.
    padded = -(-seq_len // cfg.block_q) * cfg.block_q
    assert flops.attention_pairs(seq_len, sliding_window=window) <= visited * cfg.block_q ** 2 <= padded ** 2


def test_recompute_follows_what_the_policy_keeps():
    spec = preset_config("llama", "llama3_1_8b").decoder_spec(Execution(attention_impl="flash"))
    layer = flops.layer_flops(spec, 1, 8192, attention="flash")
    per_layer = {name: flops.recompute_per_layer(PRESETS[name], layer, "flash") for name in PRESETS}
    assert per_layer["save_all"] == 0
    # recompute_all re-runs the block forward except the down projection (its output is never read back).
    assert per_layer["recompute_all"] == pytest.approx(layer.total - layer.mlp_out)
    assert per_layer["offload_inputs"] == per_layer["recompute_all"]
    # The dot presets keep every matmul output and the flash kernel's o and logsumexp
    # (both tagged ATTN_CONTEXT): no product is recomputed.
    assert per_layer["save_dots"] == per_layer["offload_dots"] == 0
    # Without ATTN_CONTEXT the kernel's forward re-runs in the backward pass.
    keep_qkv_only = OffloadPolicy.of({names.QKV: "device"})
    assert flops.recompute_per_layer(keep_qkv_only, layer, "flash") == pytest.approx(
        layer.attention + layer.attn_out + layer.mlp_hidden)
    assert flops.attention_pairs(8, causal=True) == 36 and flops.attention_pairs(8, causal=False) == 64
    assert flops.attention_pairs(8, sliding_window=3) == 6 + 5 * 3
    assert names.MLP_OUT in names.DOT_NAMES
    # 8192 tokens in blocks of 512: 16 x 17 / 2 visited blocks of 512^2 pairs.
    assert flops.flash_attention_pairs(8192, 512) == 136 * 512 * 512
