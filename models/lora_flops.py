"""Training FLOPs of one LoRA step: a frozen base (activation gradients only) and the adapters' own products.

A full fine-tune's backward pass is twice its forward matmuls: for y = x W,
one product for the input gradient (dx = dy W^T) and one for the weight
gradient (dW = x^T dy). The LoRA step differentiates the adapters only
(recipes/train/lora_step.py: the base is an input that is not
differentiated), so a frozen weight costs its input gradient alone, one
product, while the products of two activations (attention's q k^T and p v)
still need both operands' gradients. Counted here, 2 FLOPs per multiply-add,
from the shapes of models/flops.py and the adapters of a layers/lora.py
LoraSpec:

* base forward: as for a full fine-tune (models/flops.py);
* adapters forward: for a dense adapter of a weight [in, out] at rank r,
  low = x A^T (tokens x in x r) and low B^T (tokens x r x out); for a routed
  experts' adapter, the merge W_e + s A_e^T B_e^T (E x in x out x r), once a
  pass wherever the layer's weights are taken;
* backward: every frozen product once (its input gradient), attention's two
  products twice (and the blockwise kernel's recomputed scores), the
  adapters twice their forward (d low and dB, then dA and dx), a merged
  expert weight twice: its gradient dW'_e = x^T dy is formed, since A and B
  reach the loss through it, plus dA and dB from it (twice the merge);
* remat recompute: the base's (models/flops.py `recompute_per_layer`), and
  of each dense adapter its first product (low is read by dB, never named,
  so recomputed under every remat policy), both products where the
  projection's named output is recomputed (QKV, ATTN_OUT, MLP_HIDDEN; never
  MLP_OUT), and every merge (the merged weight is read by dx in the
  backward pass).

So a LoRA step of a dense model is about two thirds of a full fine-tune's
matmul FLOPs plus the adapters' (Llama 3.1 8B at rank 16 on all seven
projections, 2,048 tokens: the adapters are 0.5% of the forward).

The layer scan runs the same backward body for every layer, so the first
layer's input gradient (which no adapter needs) is counted as computed, as
it is. Checked against XLA's count of the compiled LoRA step (tests/models/
test_lora_flops.py).
"""

from __future__ import annotations

from spillway.layers import names
from spillway.layers.offload import OffloadPolicy, RematPlan
from spillway.models import flops

# The block weights an adapter can sit on (recipes/lora_targets.py names them from the HF tables) and the
# name of the activation their projection's output is saved as (MLP_OUT: never recomputed, models/flops.py).
_TAG = {("attn", "wq"): names.QKV, ("attn", "wk"): names.QKV, ("attn", "wv"): names.QKV,
        ("attn", "wo"): names.ATTN_OUT, ("mlp", "w_up"): names.MLP_HIDDEN, ("mlp", "w_gate"): names.MLP_HIDDEN,
        ("mlp", "w_down"): None}


def _in_out(block, target: tuple[str, str]) -> tuple[int, int]:
    """(in, out) of a dense block weight, its axes flattened as layers/lora.py flattens them."""
    d, h = block.d_model, block.resolved_head_dim
    return {("attn", "wq"): (d, block.num_heads * h), ("attn", "wk"): (d, block.num_kv_heads * h),
            ("attn", "wv"): (d, block.num_kv_heads * h), ("attn", "wo"): (block.num_heads * h, d),
            ("mlp", "w_up"): (d, block.mlp_hidden), ("mlp", "w_gate"): (d, block.mlp_hidden),
            ("mlp", "w_down"): (block.mlp_hidden, d)}[target]


def _known(targets) -> None:
    unknown = sorted(set(targets) - set(_TAG))
    if unknown:
        raise ValueError(f"models/lora_flops.py counts adapters on {sorted(_TAG)}, not {unknown}")


def _expert_product(layer: flops.LayerFlops, block, weight: str) -> float:
    """Forward FLOPs of one routed experts' projection (layer.mlp_hidden holds gate and up when gated)."""
    if weight == "w_down":
        return layer.mlp_out
    return layer.mlp_hidden / (2 if block.moe.gated else 1)


def _layer(layer: flops.LayerFlops, block, lora, tokens: int, policy: OffloadPolicy,
           impl: str) -> tuple[float, float, float]:
    """(forward, backward, recompute) of one block of a LoRA step."""
    frozen = layer.total - layer.attention
    backward = frozen + 2 * layer.attention + (layer.attn_scores if impl in ("flash", "cudnn") else 0.0)
    recompute = flops.recompute_per_layer(policy, layer, impl)
    adapters = 0.0
    # A fused adapter (GPT-2's c_attn over wq, wk, wv) is one adapter: x A^T once, its product with B^T over
    # the parts' outputs joined (all tagged as its first part is).
    adapted = [((target,), target) for target in lora.targets] + [
        (tuple((module, part) for part in parts), (module, parts[0])) for module, parts in lora.fused_targets]
    for weights, tagged in adapted:
        if block.moe is not None and tagged[0] == "mlp":
            continue   # a dense target's adapter sits only on weights without an expert axis (layers/lora.py)
        d_in = _in_out(block, weights[0])[0]
        d_out = sum(_in_out(block, weight)[1] for weight in weights)
        first, second = 2.0 * tokens * d_in * lora.rank, 2.0 * tokens * lora.rank * d_out
        adapters += first + second
        if policy.remat:
            tag = _TAG[tagged]
            recompute += first + (second if tag is not None and not flops.kept(policy, tag) else 0.0)
    for _, weight in (lora.expert_targets if block.moe is not None else ()):
        moe = block.moe
        d_in, d_out = (moe.expert_hidden, moe.d_model) if weight == "w_down" else (moe.d_model, moe.expert_hidden)
        merge = 2.0 * moe.num_experts * d_in * d_out * lora.rank
        adapters += merge
        backward += _expert_product(layer, block, weight)   # the merged weight's gradient
        recompute += merge if policy.remat else 0.0
    return layer.total + adapters, backward + 2 * adapters, recompute


def lora_step_flops(spec, batch: int, seq_len: int, lora, *, remat: str | OffloadPolicy | RematPlan,
                    attention_impl: str | None = None, moe_counted: str = "active") -> flops.StepFlops:
    """FLOPs of one LoRA train step (forward, backward, recompute) over `batch` sequences of `seq_len`.

    lora: the layers/lora.py LoraSpec (rank, targets, expert_targets); the rest as models/flops.py
    `train_step_flops`, which this replaces for a recipe with adapters."""
    _known(lora.targets)
    _known(lora.expert_targets)
    _known({(module, part) for module, parts in lora.fused_targets for part in parts})
    impl = attention_impl or spec.block.execution.attention_impl
    plan = RematPlan.parse(remat)
    layers = flops.stack_flops(spec, batch, seq_len, attention=flops.attention_count(impl), moe_counted=moe_counted)
    blocks = spec.layer_configs()
    policies = [policy for start, stop, policy in plan.resolve(spec.num_layers) for _ in range(start, stop)]
    head = flops.head_flops(spec, batch, seq_len)
    forward, backward, recompute = head, head, 0.0   # the frozen head: the input gradient only
    for layer, block, policy in zip(layers, blocks, policies, strict=True):
        f, b, r = _layer(layer, block, lora, batch * seq_len, policy, impl)
        forward, backward, recompute = forward + f, backward + b, recompute + r
    return flops.StepFlops(forward=forward, backward=backward, recompute=recompute)
