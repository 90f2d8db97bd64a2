"""The names of the offload contract and the logical axis names.

Every offload-aware block tags its intermediate activations with
`jax.ad_checkpoint.checkpoint_name(x, NAME)` using the constants below. An
`OffloadPolicy` (layers/offload.py) then decides per name whether the value
stays in HBM, is recomputed in the backward pass, or goes to pinned host memory.
A block that tags the standard names gets every policy preset for free.

Logical axis names label every parameter dimension (`logical_axes` metadata on
`nnx.Param`); layers/sharding.py maps them to mesh axes.
"""

# --- trace scopes -----------------------------------------------------------
# The deferred update with grad_accum > 1 (recipes/train/accumulate_in_forward.py) traces its micro-batches
# 2..K under this name, so the planner (recipes/plan/hlo.py) tells their passes from micro-batch 1's.
LATER_MICRO_BATCHES_SCOPE = "later_micro_batches"

# --- activation names (checkpoint_name tags) --------------------------------
BLOCK_INPUT = "block_input"      # residual stream entering a block, [b, t, d]
QKV = "qkv"                      # query/key/value projections after RoPE
ATTN_CONTEXT = "attn_context"    # softmax(q k^T) v, before the output projection
ATTN_OUT = "attn_out"            # attention output projection, [b, t, d]
MLP_HIDDEN = "mlp_hidden"        # MLP up (and gate) projections, [b, t, f]
MLP_OUT = "mlp_out"              # MLP down projection, [b, t, d]

ACTIVATION_NAMES = (BLOCK_INPUT, QKV, ATTN_CONTEXT, ATTN_OUT, MLP_HIDDEN, MLP_OUT)
# Outputs of matrix multiplications (and attention): expensive to recompute.
DOT_NAMES = (QKV, ATTN_CONTEXT, ATTN_OUT, MLP_HIDDEN, MLP_OUT)

# Mixture-of-experts layer (layers/moe.py). Its shared experts, if any, are a
# dense MLP and tag MLP_HIDDEN / MLP_OUT like any MLP.
ROUTER_LOGITS = "router_logits"  # router output, float32, [tokens, experts]
EXPERT_INPUT = "expert_input"    # token copies dispatched to their experts (after any exchange)
EXPERT_HIDDEN = "expert_hidden"  # expert up (and gate) projections, [token copies, f]
EXPERT_OUT = "expert_out"        # expert down projection, [token copies, d] (before the weighted combine)

MOE_ACTIVATION_NAMES = (ROUTER_LOGITS, EXPERT_INPUT, EXPERT_HIDDEN, EXPERT_OUT)
# The MoE layer's matmul outputs (router and experts); EXPERT_INPUT is a gather.
MOE_DOT_NAMES = (ROUTER_LOGITS, EXPERT_HIDDEN, EXPERT_OUT)
# Attention's matmul outputs: what the dense presets keep or offload in a block whose MLP is an MoE layer.
ATTENTION_DOT_NAMES = (QKV, ATTN_CONTEXT, ATTN_OUT)

# --- logical axis names -------------------------------------------------------
BATCH = "batch"
SEQ = "seq"
EMBED = "embed"
VOCAB = "vocab"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
LAYERS = "layers"
NORM = "norm"
EXPERT = "expert"     # the leading axis of stacked expert weights [experts, d, f] (layers/moe.py)

# Activation feature axes. Separate from the parameter axes because the two
# shard differently: a weight's embed axis is split over "fsdp", but an
# activation is split over the batch on "fsdp", and splitting its embed axis
# too would leave each device a slice of d_model for the whole global batch.
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

# The residual stream [batch, seq, d_model] between and inside blocks.
RESIDUAL_AXES = (BATCH, SEQ, ACT_EMBED)
