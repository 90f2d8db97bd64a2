"""Training FLOPs of one step, counted from the model's shapes, including what remat recomputes.

A deviceless GPU compile reports no FLOPs (`cost_analysis()` is empty there,
docs/DESIGN.md section 5), so the planner counts them itself. What is counted:

* matrix multiplications: the q/k/v, output, MLP (gate,) up and down
  projections and the output head, 2 FLOPs per multiply-add;
* attention: the scores q k^T and the context p v, over the (query, key)
  pairs each implementation really multiplies: for "flash"
  (layers/flash_attention.py) every element of every block the kernel visits,
  masked elements of the diagonal blocks included (`flash_attention_pairs`);
  t^2 for "full" (XLA's dense attention multiplies first and masks after);
  t (t + 1) / 2 for "causal", the pairs the mask lets through (what MFU counts,
  and the planner's figure for cuDNN's kernel, whose blocks it does not know);
* the backward pass: twice the forward matmuls (one product for the input
  gradient, one for the weight gradient). Flash attention's backward also
  recomputes the scores from q, k and the saved logsumexp: half of an
  attention forward more, counted in `backward`;
* remat recompute, from the offload plan (see `recompute_per_layer`).

Not counted: elementwise work (norms, RoPE, SiLU, softmax exponentials,
residual adds, the loss), the embedding lookup (a gather) and the optimizer
update. For a model whose matmuls dominate, that is a few percent.
tests/models/test_flops.py checks the count against XLA's own
(`cost_analysis()` of CPU compiles): forward, backward (the flash kernel's
custom backward included) and the recompute of every offload preset.

Mixture-of-experts layers (a block whose `moe` is set: Mixtral, Qwen3-MoE)
count their MLP slot by layers/moe_flops.py: the router (tokens x d x E, in
`router`, with a shared-expert gate), and in `mlp_hidden` / `mlp_out` the k
experts each token goes through (and any shared experts), not all E. That
"active" count is what MFU divides by (`model_flops_per_token`). The planner's
compute time counts what the chosen dispatch multiplies (`moe_counted=
"executed"`: every capacity slot, every row of the blocked loop's padded
blocks). In the backward pass an MoE layer's recompute follows its own tags:
EXPERT_HIDDEN (gate and up products), EXPERT_OUT (the down product: the combine
weights' gradient reads it, unlike a dense MLP_OUT) and ROUTER_LOGITS.

A LoRA step (a frozen base, trained adapters) is counted by models/lora_flops.py
from these per-layer figures: no weight gradient of the base, the adapters'
own products.

Pure arithmetic on a DecoderSpec (models/decoder.py), the shape description
every family gives: plain or gated MLP, grouped-query attention, sliding
windows, counted layer by layer from each layer's own config
(`spec.layer_configs()`: Gemma's local layers attend through a window, its
global ones do not). Nothing is traced or compiled, no device is needed.
"""

from __future__ import annotations

import dataclasses

from spillway.layers import names
from spillway.layers.moe_flops import moe_layer_flops
from spillway.layers.offload import OffloadPolicy, Placement, RematPlan

@dataclasses.dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one block for a whole batch, by the product that makes them."""

    qkv: float
    attn_scores: float
    attn_context: float
    attn_out: float
    mlp_hidden: float      # gate and up projections (of an MoE layer: its experts', top-k per token, and shared)
    mlp_out: float         # down projection (likewise)
    router: float = 0.0    # an MoE layer's router (and shared-expert gate); 0 for a dense block
    moe: bool = False      # the MLP slot is an MoE layer (its recompute follows the expert tags)

    @property
    def attention(self) -> float:
        return self.attn_scores + self.attn_context

    @property
    def total(self) -> float:
        return self.qkv + self.attention + self.attn_out + self.mlp_hidden + self.mlp_out + self.router


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one train step (all devices together)."""

    forward: float
    backward: float
    recompute: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "recompute": self.recompute,
                "total": self.total}


def attention_pairs(seq_len: int, *, causal: bool = True, sliding_window: int | None = None) -> int:
    """(query, key) pairs one sequence's attention computes."""
    t = seq_len
    if not causal:
        return t * t
    if sliding_window is None or sliding_window >= t:
        return t * (t + 1) // 2
    w = sliding_window
    # Query i sees min(i + 1, w) keys: a triangle, then a band of width w.
    return w * (w + 1) // 2 + (t - w) * w


def flash_attention_pairs(seq_len: int, block: int, *, sliding_window: int | None = None) -> int:
    """(query, key) pairs layers/flash_attention.py multiplies for one causal sequence.

    The kernel clips its block to the sequence, pads the sequence to whole
    blocks and, per query block, runs over the key blocks from the first that
    holds a key inside the window to the one holding its last query: every
    element of those blocks is computed, masked or not.
    """
    b = max(1, min(block, seq_len))
    pairs = 0
    for first_query in range(0, seq_len, b):
        last_query = min(first_query + b, seq_len) - 1
        stop = last_query // b + 1
        start = 0 if sliding_window is None else max(0, (first_query - sliding_window + 1) // b)
        pairs += (stop - start) * b * b
    return pairs


ATTENTION_COUNTS = ("causal", "full", "flash")


def layer_flops(spec, batch: int, seq_len: int, *, attention: str = "causal", layer: int = 0,
                moe_counted: str = "active") -> LayerFlops:
    """Forward FLOPs of one block of `spec` (a DecoderSpec) for `batch` sequences of `seq_len`.

    layer: which layer (its own config: Gemma's local and global layers differ
    in their window); default the first.
    attention: "causal" counts only the pairs the mask keeps, "full" every
    pair (XLA's dense attention, which masks after multiplying), "flash" the
    blocks layers/flash_attention.py computes (block: the spec's
    execution.flash_block_size).
    """
    return block_flops(spec.layer_configs()[layer], batch, seq_len, attention=attention, moe_counted=moe_counted)


def block_flops(b, batch: int, seq_len: int, *, attention: str = "causal", moe_counted: str = "active") -> LayerFlops:
    """Forward FLOPs of one block of config `b` (a BlockConfig): see `layer_flops`.

    moe_counted: of an MoE block, "active" (k experts a token) or "executed" (what its dispatch multiplies)."""
    if attention not in ATTENTION_COUNTS:
        raise ValueError(f"attention must be one of {ATTENTION_COUNTS}, got {attention!r}")
    tokens = batch * seq_len
    d, h = b.d_model, b.resolved_head_dim
    n, kv = b.num_heads, b.num_kv_heads
    if attention == "flash":
        pairs = batch * flash_attention_pairs(seq_len, b.execution.flash_block_size, sliding_window=b.sliding_window)
    else:
        pairs = batch * attention_pairs(seq_len, causal=attention == "causal",
                                        sliding_window=b.sliding_window if attention == "causal" else None)
    attention_flops = dict(qkv=2.0 * tokens * d * (n + 2 * kv) * h, attn_scores=2.0 * pairs * n * h,
                           attn_context=2.0 * pairs * n * h, attn_out=2.0 * tokens * n * h * d)
    if b.moe is not None:
        moe = moe_layer_flops(b.moe, batch, seq_len, counted=moe_counted)
        return LayerFlops(**attention_flops, mlp_hidden=moe.expert_hidden + moe.shared_hidden,
                          mlp_out=moe.expert_out + moe.shared_out, router=moe.router + moe.shared_gate, moe=True)
    return LayerFlops(
        **attention_flops,
        mlp_hidden=2.0 * tokens * d * b.mlp_hidden * (2 if b.gated_mlp else 1),   # gated: gate and up
        mlp_out=2.0 * tokens * b.mlp_hidden * d,
    )


def stack_flops(spec, batch: int, seq_len: int, *, attention: str = "causal",
                moe_counted: str = "active") -> list[LayerFlops]:
    """Forward FLOPs of every layer, first layer first (layers differ where their windows or MLPs do)."""
    cache: dict = {}   # layers of one config (most of them) are counted once
    out = []
    for b in spec.layer_configs():
        if b not in cache:
            cache[b] = block_flops(b, batch, seq_len, attention=attention, moe_counted=moe_counted)
        out.append(cache[b])
    return out


def head_flops(spec, batch: int, seq_len: int) -> float:
    """The output projection to the vocabulary (tied or not, the same product)."""
    return 2.0 * batch * seq_len * spec.d_model * spec.vocab_size


def forward_flops(spec, batch: int, seq_len: int, *, attention: str = "causal", moe_counted: str = "active") -> float:
    return sum(layer.total for layer in stack_flops(spec, batch, seq_len, attention=attention,
                                                    moe_counted=moe_counted)) + head_flops(spec, batch, seq_len)


def model_flops_per_token(spec, seq_len: int) -> float:
    """Training FLOPs per token without remat (forward + backward = 3x forward, causal attention): what MFU divides by."""
    return 3.0 * forward_flops(spec, 1, seq_len) / seq_len


def kept(policy: OffloadPolicy, name: str) -> bool:
    """Whether the policy keeps `name` for the backward pass (in HBM or in host memory)."""
    for tagged, placement in policy.placements:
        if tagged == name:
            return placement in (Placement.DEVICE, Placement.HOST)
    return policy.default == Placement.DEVICE


def recompute_per_layer(policy: OffloadPolicy, layer: LayerFlops, attention_impl: str) -> float:
    """Forward FLOPs the backward pass of one block re-runs under `policy`.

    What the backward pass of a standard block reads, and so what must be
    recomputed when the policy keeps it nowhere:

      q, k, v (QKV)            the attention backward    -> the qkv projection
      attention residuals      the attention backward    -> flash: o and lse, both
                               tagged ATTN_CONTEXT; without them the kernel's
                               forward re-runs. Dense attention: the
                               probabilities (never named) are always
                               recomputed from q, k; p v only if ATTN_CONTEXT
                               is not kept.
      ATTN_CONTEXT             the input of the output projection
      ATTN_OUT                 the MLP norm's input x + attn_out -> the output projection
      MLP_HIDDEN               SiLU(gate) * up and its derivative -> gate and up projections
      MLP_OUT                  nothing: the backward of a residual add needs no values,
                               so the down projection is never recomputed (JAX's remat
                               drops unused recompute).

    Elementwise work between the products is recomputed too, and not counted.
    """
    if not policy.remat:
        return 0.0
    flops = 0.0
    if not kept(policy, names.QKV):
        flops += layer.qkv
    context_kept = kept(policy, names.ATTN_CONTEXT)
    if attention_impl in ("flash", "cudnn"):
        # Flash-style kernels need their own forward's output and logsumexp (one tag).
        if not context_kept:
            flops += layer.attention
    else:
        flops += layer.attn_scores
        if not context_kept:
            flops += layer.attn_context
    if not kept(policy, names.ATTN_OUT):
        flops += layer.attn_out
    if layer.moe:
        # The shared experts' MLP (tagged MLP_HIDDEN) is counted with the experts, under the expert tags.
        if not kept(policy, names.EXPERT_HIDDEN):
            flops += layer.mlp_hidden
        if not kept(policy, names.EXPERT_OUT):
            flops += layer.mlp_out
        if not kept(policy, names.ROUTER_LOGITS):
            flops += layer.router
    elif not kept(policy, names.MLP_HIDDEN):
        flops += layer.mlp_hidden
    return flops


def attention_count(impl: str) -> str:
    """How an attention implementation's pairs are counted (see `train_step_flops`)."""
    return {"xla": "full", "flash": "flash"}.get(impl, "causal")


def train_step_flops(spec, batch: int, seq_len: int, *, remat: str | OffloadPolicy | RematPlan,
                     attention_impl: str | None = None, moe_counted: str = "active") -> StepFlops:
    """FLOPs of one forward + backward (+ remat recompute) over `batch` sequences of `seq_len`.

    remat: the activation plan; attention_impl: default the spec's execution
    setting. Dense ("xla") attention is counted over every pair, "flash" over
    the blocks the kernel computes, "cudnn" over the causal pairs. moe_counted:
    MoE layers' "active" FLOPs (MFU) or those their dispatch "executed" (the
    planner's compute time).
    """
    impl = attention_impl or spec.block.execution.attention_impl
    plan = RematPlan.parse(remat)
    layers = stack_flops(spec, batch, seq_len, attention=attention_count(impl), moe_counted=moe_counted)
    head = head_flops(spec, batch, seq_len)
    forward = sum(layer.total for layer in layers) + head
    backward = 2.0 * forward
    if impl in ("flash", "cudnn"):
        backward += sum(layer.attn_scores for layer in layers)   # scores recomputed in the kernel's backward
    recompute = sum(recompute_per_layer(policy, layers[i], impl)
                    for start, stop, policy in plan.resolve(spec.num_layers) for i in range(start, stop))
    return StepFlops(forward=forward, backward=backward, recompute=recompute)
