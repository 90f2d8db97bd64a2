"""FLOPs of the MoE families (models/flops.py with layers/moe_flops.py): k of E experts per token.

A hand-worked count of Mixtral 8x7B's training FLOPs per token, and XLA's own
count (`cost_analysis()` of the CPU compile of value_and_grad of the loss) of a
tiny two-layer Mixtral on the capacity dispatch, whose einsums multiply every
slot (so "executed" is what XLA sees), without remat and with every block
recomputed. As in tests/models/test_flops.py, a scan's body is counted once, so
a two-layer model reads as one layer.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from spillway.layers.execution import Execution
from spillway.layers.offload import MOE_PRESETS
from spillway.layers.offload import PRESETS as DENSE_PRESETS
from spillway.models import flops
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config
from spillway.recipes.train.step import make_loss_fn
from spillway.recipes.train.batch import Batch

PRESETS = {**DENSE_PRESETS, **MOE_PRESETS}


def test_mixtral_8x7b_flops_per_token_by_hand():
    """Sequence 4096, causal attention. Per layer and token, 2 FLOPs per multiply-add:
    q/k/v 2 x 4096 x (32 + 2 x 8) x 128, output 2 x 4096 x 4096, scores and context 2 x 2 x (4097 / 2) x 4096
    (query i sees i + 1 keys), router 2 x 4096 x 8, and two experts of 14336: gate and up 2 x 2 x 2 x 4096 x
    14336, down 2 x 2 x 14336 x 4096. The head: 2 x 4096 x 32000. Training: 3 x forward."""
    qkv = 2 * 4096 * 48 * 128                  # 50,331,648
    out = 2 * 4096 * 4096                      # 33,554,432
    attention = 2 * 2 * 4097 * 4096 // 2       # 33,562,624
    router = 2 * 4096 * 8                      # 65,536
    experts = 2 * 2 * 2 * 4096 * 14336 + 2 * 2 * 14336 * 4096   # 704,643,072
    head = 2 * 4096 * 32000                    # 262,144,000
    forward = 32 * (qkv + out + attention + router + experts) + head
    assert forward == 26_571_177_984
    spec = preset_config("mixtral", "mixtral_8x7b").decoder_spec()
    assert flops.model_flops_per_token(spec, 4096) == 3 * forward == 79_713_533_952
    # All 8 experts would be 4x the expert FLOPs: what counting every expert (a dense model of 46.7B) gives.
    dense_like = 32 * (qkv + out + attention + router + 4 * experts) + head
    assert flops.forward_flops(spec, 1, 4096) / 4096 == forward < 0.45 * dense_like


def test_executed_counts_the_capacity_slots_and_the_recompute_follows_the_expert_tags():
    cfg = preset_config("qwen3_moe", "tiny", moe_dispatch="capacity", moe_capacity_factor=2.0)
    spec = cfg.decoder_spec()
    active = flops.layer_flops(spec, 2, 64)
    executed = flops.layer_flops(spec, 2, 64, moe_counted="executed")
    # 8 experts x ceil(2 x 2 x 64 / 8) = 32 slots per sequence, against 64 tokens x 2 copies: twice the work.
    assert executed.mlp_out == 2 * active.mlp_out and executed.router == active.router
    layer = active
    recompute = {name: flops.recompute_per_layer(PRESETS[name], layer, "xla")
                 for name in ("recompute_all", "moe_save_dots", "moe_offload_experts", "moe_recompute_experts")}
    # Everything: a dense MLP never recomputes its down projection, an MoE layer does (the combine weights'
    # gradient reads the experts' outputs).
    assert recompute["recompute_all"] == pytest.approx(layer.total)
    # XLA's dense attention always recomputes its probabilities (never tagged): the scores product.
    assert recompute["moe_save_dots"] == recompute["moe_offload_experts"] == pytest.approx(layer.attn_scores)
    assert recompute["moe_recompute_experts"] == pytest.approx(layer.attn_scores + layer.mlp_hidden + layer.mlp_out)


BATCH, SEQ = 2, 64
TINY = dict(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=192, num_experts=4,
            top_k=2, max_seq_len=128, moe_dispatch="capacity", moe_capacity_factor=1.0)


@functools.cache
def xla_step_flops(remat: str) -> float:
    cfg = preset_config("mixtral", "tiny", **TINY)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, Execution(), rngs=nnx.Rngs(0), remat=remat)))
    tokens = Batch(tokens=jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32))
    compiled = jax.jit(jax.value_and_grad(make_loss_fn(graphdef))).lower(params, tokens).compile()
    return compiled.cost_analysis()["flops"]


def test_step_flops_match_xla_on_the_capacity_dispatch():
    spec = preset_config("mixtral", "tiny", **dict(TINY, num_layers=1)).decoder_spec()
    counted = {remat: flops.train_step_flops(spec, BATCH, SEQ, remat=remat, moe_counted="executed")
               for remat in ("save_all", "recompute_all")}
    theirs = {remat: xla_step_flops(remat) for remat in counted}
    assert theirs["save_all"] == pytest.approx(counted["save_all"].total, rel=0.03)
    recompute_xla = theirs["recompute_all"] - theirs["save_all"]
    assert abs(recompute_xla - counted["recompute_all"].recompute) <= 0.015 * counted["recompute_all"].total
