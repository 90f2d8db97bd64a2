"""Multi-head attention with MHA / GQA / MQA, causal mask, optional sliding window.

Three implementations, chosen per model (`impl`):

    "xla"    jax.nn.dot_product_attention(implementation="xla"): runs everywhere,
             but materialises the [t, s] scores per head: memory quadratic in
             the sequence (measured for one 8192-token layer on an H200
             target in docs/DESIGN.md section 5).
    "cudnn"  jax.nn.dot_product_attention(implementation="cudnn"): cuDNN flash
             attention on NVIDIA GPUs; cannot be compiled without cuDNN. Off a
             GPU the layer computes the same attention with "xla" (a GPU
             recipe's model still builds and samples on a CPU).
    "flash"  layers/flash_attention.py: blockwise attention in plain JAX with its
             own backward pass; memory linear in the sequence, compiles
             everywhere (the planner plans with it).

Options for the families: biases on the q/k/v projections (Qwen2, GPT-2) and
on the output projection (GPT-2), an RMSNorm over each head's q and k before
RoPE (Qwen3; Gemma 3 with the (1 + w) RMSNorm, `qk_norm_kind`), and no RoPE at
all (GPT-2, whose positions are learned and added to the embedding). Gemma:
`softcap` c caps the scores as c * tanh(s / c) before the mask (every
implementation but cuDNN, which has no soft-cap: BlockConfig refuses the
pair), `scale` replaces 1 / sqrt(head_dim).

Per-layer values (`layer_values`, layers/layer_values.py: a traced window,
0 = global, and a traced RoPE base and linear scale) replace the static
`sliding_window` and `rope_theta` of the call they are given to. The flash
kernel takes the traced window as data (it still skips key blocks outside
it); "xla" builds its mask from it (layers/attention_reference.py); cuDNN
takes only a static window, so a traced one there is a ConfigError. Without
layer_values and soft-cap every path is the program it was before them.

Tags: q, k and v after RoPE as QKV; the attention context as ATTN_CONTEXT; the
output projection as ATTN_OUT. Decoding uses a per-layer KV cache
({"k": [b, S, kv, h], "v": ...}) written at `cache_index`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import lora, names
from spillway.layers.attention_reference import causal_mask, masked_attention
from spillway.layers.errors import ConfigError, require_positive_finite
from spillway.layers.execution import ATTENTION_IMPLS
from spillway.layers.layer_values import LayerValues
from spillway.layers.names import RESIDUAL_AXES
from spillway.layers.norm import make_norm
from spillway.layers.params import normal, param
from spillway.layers.rope import RopeScaling, apply_rope, inverse_frequencies, traced_inverse_frequencies
from spillway.layers.sharding import constrain

_Q_AXES = (names.BATCH, names.SEQ, names.ACT_HEADS, None)
_KV_AXES = (names.BATCH, names.SEQ, names.ACT_KV_HEADS, None)


def check_head_layout(d_model: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> int:
    """Validate the head counts; returns head_dim (d_model // num_heads when None)."""
    if num_heads <= 0 or num_kv_heads <= 0:
        raise ConfigError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be positive")
    if head_dim is None:
        if d_model % num_heads:
            raise ConfigError(f"num_heads ({num_heads}) does not divide d_model ({d_model})")
        head_dim = d_model // num_heads
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_kv_heads ({num_kv_heads}) does not divide num_heads ({num_heads})")
    return head_dim


class Attention(nnx.Module):
    LORA_IN_NDIM = {"wo": 2}   # wo [heads, head_dim, d]: its input is two axes (layers/lora.py)

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, head_dim: int | None = None,
                 rope_theta: float = 10000.0, rope_scaling: RopeScaling | None = None,
                 sliding_window: int | None = None, impl: str = "xla", qkv_bias: bool = False,
                 out_bias: bool = False, qk_norm: bool = False, qk_norm_eps: float = 1e-6,
                 qk_norm_kind: str = "rms", softcap: float | None = None, scale: float | None = None,
                 rope: bool = True, dtype=jnp.float32, param_dtype=jnp.float32, init_std: float = 0.02,
                 flash_block_size: int = 512, rngs: nnx.Rngs):
        head_dim = check_head_layout(d_model, num_heads, num_kv_heads, head_dim)
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; known: {ATTENTION_IMPLS}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        require_positive_finite("attention", softcap=softcap, scale=scale)
        if softcap is not None and impl == "cudnn":
            raise ConfigError("attention: cuDNN's fused attention has no logit soft-capping; use impl='flash'")
        if qk_norm_kind not in ("rms", "rms_plus_one"):
            raise ConfigError(f"attention.qk_norm_kind must be 'rms' or 'rms_plus_one', got {qk_norm_kind!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.softcap, self.scale = softcap, scale
        self.impl = impl
        self.dtype = dtype
        self.flash_block_size = flash_block_size
        # Plain Python config, not arrays: the frequencies are recomputed (constant-folded) per call.
        self.rope, self.rope_theta, self.rope_scaling = rope, rope_theta, rope_scaling
        init = normal(init_std)
        self.wq = param(rngs, init, (d_model, num_heads, head_dim), (names.EMBED, names.HEADS, names.HEAD_DIM), param_dtype)
        self.wk = param(rngs, init, (d_model, num_kv_heads, head_dim), (names.EMBED, names.KV_HEADS, names.HEAD_DIM), param_dtype)
        self.wv = param(rngs, init, (d_model, num_kv_heads, head_dim), (names.EMBED, names.KV_HEADS, names.HEAD_DIM), param_dtype)
        self.wo = param(rngs, init, (num_heads, head_dim, d_model), (names.HEADS, names.HEAD_DIM, names.EMBED), param_dtype)
        zeros = jax.nn.initializers.zeros
        if qkv_bias:
            bias_axes, kv_bias_axes = (names.HEADS, names.HEAD_DIM), (names.KV_HEADS, names.HEAD_DIM)
            self.bq = param(rngs, zeros, (num_heads, head_dim), bias_axes, param_dtype, weight_decay=False)
            self.bk = param(rngs, zeros, (num_kv_heads, head_dim), kv_bias_axes, param_dtype, weight_decay=False)
            self.bv = param(rngs, zeros, (num_kv_heads, head_dim), kv_bias_axes, param_dtype, weight_decay=False)
        else:
            self.bq = self.bk = self.bv = None
        self.bo = param(rngs, zeros, (d_model,), (names.NORM,), param_dtype, weight_decay=False) if out_bias else None
        # Qwen3, Gemma 3: one RMSNorm (scale over head_dim) shared by all query heads, one by all key heads.
        make_qk_norm = lambda: make_norm(qk_norm_kind, head_dim, eps=qk_norm_eps, rngs=rngs)  # noqa: E731
        self.q_norm = make_qk_norm() if qk_norm else None
        self.k_norm = make_qk_norm() if qk_norm else None

    def _project(self, x_btd, w, b, delta):
        y = jnp.einsum("btd,dnh->btnh", x_btd, w[...].astype(self.dtype))
        if delta is not None:   # the projection's LoRA term (None without an adapter)
            y = y + delta.reshape(y.shape)
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, cache: dict | None = None,
                 cache_index: jax.Array | None = None, *, layer_values: LayerValues | None = None,
                 segment_ids_bt: jax.Array | None = None):
        """Returns (out_btd, new_cache). `cache` is None in training; `layer_values` (traced window, RoPE
        base and scale) replace the static window and base when given; `segment_ids_bt` (training only):
        packed examples, each seeing only itself (layers/segment_mask.py)."""
        x_btd = x_btd.astype(self.dtype)
        # One call for the three: GPT-2's c_attn adapter is one over q, k and v (layers/lora.py).
        deltas = lora.adapter_deltas(self, ("wq", "wk", "wv"), x_btd, 1, self.dtype)
        q_btnh = self._project(x_btd, self.wq, self.bq, deltas["wq"])
        k_btkh = self._project(x_btd, self.wk, self.bk, deltas["wk"])
        v_btkh = self._project(x_btd, self.wv, self.bv, deltas["wv"])
        if self.q_norm is not None:
            q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
        if self.rope:
            if layer_values is None:
                inv_freq = inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
            else:
                inv_freq = traced_inverse_frequencies(self.head_dim, layer_values.rope_theta,
                                                      layer_values.rope_scale, self.rope_scaling)
            q_btnh = apply_rope(q_btnh, positions_bt, inv_freq)
            k_btkh = apply_rope(k_btkh, positions_bt, inv_freq)
        q_btnh = checkpoint_name(constrain(q_btnh, _Q_AXES), names.QKV)
        k_btkh = checkpoint_name(constrain(k_btkh, _KV_AXES), names.QKV)
        v_btkh = checkpoint_name(constrain(v_btkh, _KV_AXES), names.QKV)

        if cache is not None:
            k_bskh = jax.lax.dynamic_update_slice_in_dim(cache["k"], k_btkh.astype(cache["k"].dtype), cache_index, 1)
            v_bskh = jax.lax.dynamic_update_slice_in_dim(cache["v"], v_btkh.astype(cache["v"].dtype), cache_index, 1)
            cache = {"k": k_bskh, "v": v_bskh}
            batch, max_len = k_bskh.shape[:2]
            kv_positions_bs = jnp.broadcast_to(jnp.arange(max_len), (batch, max_len))
            context_btnh = self._attend(q_btnh, k_bskh.astype(self.dtype), v_bskh.astype(self.dtype),
                                        positions_bt, kv_positions_bs, layer_values)
        elif segment_ids_bt is not None:
            context_btnh = self._attend_segments(q_btnh, k_btkh, v_btkh, segment_ids_bt, layer_values)
        else:
            context_btnh = self._attend(q_btnh, k_btkh, v_btkh, None, None, layer_values)
        context_btnh = checkpoint_name(constrain(context_btnh, _Q_AXES), names.ATTN_CONTEXT)
        out_btd = jnp.einsum("btnh,nhd->btd", context_btnh, self.wo[...].astype(self.dtype))
        delta = lora.adapter_delta(self, "wo", context_btnh, 2, self.dtype)
        if delta is not None:
            out_btd = out_btd + delta
        if self.bo is not None:
            out_btd = out_btd + self.bo[...].astype(self.dtype)
        return checkpoint_name(constrain(out_btd, RESIDUAL_AXES), names.ATTN_OUT), cache

    def _attend_segments(self, q_btnh, k_bskh, v_bskh, segment_ids_bt, layer_values):
        """Attention within each packed example (layers/segment_mask.py); cuDNN is refused by name."""
        from spillway.layers.segment_mask import check_segment_support, segment_causal_mask

        window = self.sliding_window if layer_values is None else layer_values.sliding_window
        if self.impl == "flash":
            from spillway.layers.flash_attention import flash_attention
            return flash_attention(q_btnh, k_bskh, v_bskh, causal=True, sliding_window=window,
                                   q_segment_ids_bt=segment_ids_bt, kv_segment_ids_bs=segment_ids_bt,
                                   block_q=self.flash_block_size, block_k=self.flash_block_size,
                                   scale=self.scale, softcap=self.softcap)
        if self.impl == "cudnn" and jax.default_backend() == "gpu":
            check_segment_support(self.impl)
        mask = segment_causal_mask(segment_ids_bt, window)
        if self.softcap is not None:
            return masked_attention(q_btnh, k_bskh, v_bskh, mask, scale=self.scale, softcap=self.softcap)
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask, scale=self.scale,
                                            implementation="xla")

    def _attend(self, q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs, layer_values):
        # A traced window (int32 scalar, 0 = global) when the layer's values are given, else the static one.
        window = self.sliding_window if layer_values is None else layer_values.sliding_window
        if self.impl == "flash":
            from spillway.layers.flash_attention import flash_attention
            return flash_attention(q_btnh, k_bskh, v_bskh, causal=True, sliding_window=window,
                                   q_positions_bt=q_positions_bt, kv_positions_bs=kv_positions_bs,
                                   block_q=self.flash_block_size, block_k=self.flash_block_size,
                                   scale=self.scale, softcap=self.softcap)
        if q_positions_bt is not None or layer_values is not None or self.softcap is not None:
            # Decoding against a cache, a traced window or soft-capped scores: an explicit mask from
            # positions (the cache's unwritten tail has positions beyond the query and is masked).
            if self.impl == "cudnn" and q_positions_bt is None:
                raise ConfigError("attention_impl='cudnn' takes only a static sliding window, not a per-layer "
                                  "(traced) one; use attention_impl='flash'")
            if q_positions_bt is None:
                b, t, s = q_btnh.shape[0], q_btnh.shape[1], k_bskh.shape[1]
                q_positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
                kv_positions_bs = jnp.broadcast_to(jnp.arange(s), (b, s))
            mask = causal_mask(q_positions_bt, kv_positions_bs, window)
            if self.softcap is not None:
                return masked_attention(q_btnh, k_bskh, v_bskh, mask, scale=self.scale, softcap=self.softcap)
            return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask, scale=self.scale,
                                                implementation="xla")
        window = None if self.sliding_window is None else (self.sliding_window - 1, 0)
        impl = self.impl
        if impl == "cudnn" and jax.default_backend() != "gpu":
            # The same maths where there is no cuDNN, so a GPU recipe's model builds, samples and is
            # checked on a CPU; training refuses it there (recipes/train/step.py check_attention_backend).
            impl = "xla"
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=True, scale=self.scale,
                                            local_window_size=window, implementation=impl)
