"""Feed-forward layers: gated (SwiGLU, GeGLU) and plain GELU MLPs, with or without biases.

Both GELUs are the tanh approximation: "geglu" is Gemma's gated MLP
(transformers' `gelu_pytorch_tanh`), down(gelu_tanh(gate(x)) * up(x)); "gelu"
is GPT-2's `gelu_new`.

Both tag their matmul outputs: the up/gate projections as MLP_HIDDEN and the
down projection as MLP_OUT, so an OffloadPolicy can keep, offload or recompute
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import lora, names
from spillway.layers.names import RESIDUAL_AXES
from spillway.layers.params import normal, param
from spillway.layers.sharding import constrain

_HIDDEN_AXES = (names.BATCH, names.SEQ, names.ACT_MLP)

ACTIVATIONS = {
    "swiglu": jax.nn.silu,
    "geglu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
}
GATED = {"swiglu", "geglu"}


class MLP(nnx.Module):
    """`kind` is "swiglu" / "geglu" (gated, three matrices) or "gelu" (two matrices)."""

    def __init__(self, d_model: int, hidden: int, *, kind: str = "swiglu", bias: bool = False, dtype=jnp.float32,
                 param_dtype=jnp.float32, init_std: float = 0.02, rngs: nnx.Rngs):
        if kind not in ACTIVATIONS:
            raise ValueError(f"unknown mlp kind {kind!r}; known kinds: {sorted(ACTIVATIONS)}")
        self.kind = kind
        self.dtype = dtype
        init = normal(init_std)
        self.w_up = param(rngs, init, (d_model, hidden), (names.EMBED, names.MLP), param_dtype)
        if kind in GATED:
            self.w_gate = param(rngs, init, (d_model, hidden), (names.EMBED, names.MLP), param_dtype)
        self.w_down = param(rngs, init, (hidden, d_model), (names.MLP, names.EMBED), param_dtype)
        zeros = jax.nn.initializers.zeros
        bias_param = lambda size, axis: param(rngs, zeros, (size,), (axis,), param_dtype, weight_decay=False)  # noqa: E731
        self.b_up = bias_param(hidden, names.MLP) if bias else None
        self.b_gate = bias_param(hidden, names.MLP) if bias and kind in GATED else None
        self.b_down = bias_param(d_model, names.NORM) if bias else None

    def _linear(self, x, w, b, name):
        y = x @ w[...].astype(self.dtype)
        delta = lora.adapter_delta(self, name, x, 1, self.dtype)   # None without a LoRA adapter
        if delta is not None:
            y = y + delta
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x_btd = x_btd.astype(self.dtype)
        act = ACTIVATIONS[self.kind]
        up_btf = self._linear(x_btd, self.w_up, self.b_up, "w_up")
        up_btf = checkpoint_name(constrain(up_btf, _HIDDEN_AXES), names.MLP_HIDDEN)
        if self.kind in GATED:
            gate_btf = self._linear(x_btd, self.w_gate, self.b_gate, "w_gate")
            gate_btf = checkpoint_name(constrain(gate_btf, _HIDDEN_AXES), names.MLP_HIDDEN)
            hidden_btf = act(gate_btf) * up_btf
        else:
            hidden_btf = act(up_btf)
        out_btd = constrain(self._linear(hidden_btf, self.w_down, self.b_down, "w_down"), RESIDUAL_AXES)
        return checkpoint_name(out_btd, names.MLP_OUT)
