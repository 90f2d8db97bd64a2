"""MoE: a mixture-of-experts feed-forward layer, a drop-in for the MLP of a block.

    router        float32 logits and softmax, top-k, combine weights renormalised or not
                  (layers/router.py)
    experts       stacked gated-MLP weights [experts, d, f] (gate, up) and [experts, f, d]
                  (down), the activation kinds of layers/mlp.py
    dispatch      "dropless" or "capacity" (layers/moe_dispatch.py), one interface; dropless
                  multiplies by `jax.lax.ragged_dot` or by blocks (layers/grouped_matmul.py)
    shared        optionally a dense MLP every token goes through (Qwen2-MoE, DeepSeek),
                  optionally scaled by sigmoid(x @ w_shared_gate) (Qwen2-MoE)

`MoE(cfg)(x)` returns the output like an MLP and emits its `RouterStats`
through the auxiliary-output channel (layers/aux_outputs.py) under
`cfg.aux_key`, so `TransformerBlock.make_mlp` can return it unchanged;
`MoE.apply(x)` returns (output, stats) for direct use.

It tags ROUTER_LOGITS, EXPERT_INPUT, EXPERT_HIDDEN and EXPERT_OUT
(layers/names.py), and its shared experts, being an MLP, MLP_HIDDEN and
MLP_OUT: the MoE presets of layers/offload.py keep, recompute or offload them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from spillway.layers import aux_outputs, lora, moe_dispatch, names
from spillway.layers.errors import ConfigError, require_positive
from spillway.layers.execution import Execution
from spillway.layers.grouped_matmul import blocked_grouped_matmul
from spillway.layers.mlp import ACTIVATIONS, GATED, MLP
from spillway.layers.params import normal, param
from spillway.layers.router import Router, RouterStats, route, router_stats
from spillway.layers.sharding import DEFAULT_RULES, current_activation_mesh

DISPATCHES = ("dropless", "capacity")
GROUPED_MATMULS = ("ragged_dot", "blocked")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: `num_experts` experts of hidden size `expert_hidden`, `top_k` per token."""

    d_model: int
    num_experts: int
    top_k: int
    expert_hidden: int
    mlp_kind: str = "swiglu"          # "swiglu" | "geglu" | "gelu" (layers/mlp.py)
    renormalize: bool = True          # top-k weights divided by their sum (Mixtral, Qwen3-MoE norm_topk_prob)
    dispatch: str = "dropless"        # "dropless" | "capacity" (layers/moe_dispatch.py)
    capacity_factor: float = 1.25     # slots per expert = ceil(factor * k * tokens / E), capacity dispatch only
    grouped_matmul: str = "ragged_dot"  # dropless only: "ragged_dot" | "blocked" (layers/grouped_matmul.py)
    grouped_matmul_block: int = 128   # rows per block of the "blocked" grouped matmul
    shared_expert_hidden: int = 0     # hidden size of the shared experts' dense MLP; 0: none
    shared_expert_gate: bool = False  # scale the shared output by sigmoid(x @ w) (Qwen2-MoE)
    aux_key: str = "moe"              # the key its RouterStats are emitted under
    execution: Execution = Execution()

    def __post_init__(self):
        require_positive("moe", d_model=self.d_model, num_experts=self.num_experts, top_k=self.top_k,
                         expert_hidden=self.expert_hidden, capacity_factor=self.capacity_factor,
                         grouped_matmul_block=self.grouped_matmul_block)
        if self.top_k > self.num_experts:
            raise ConfigError(f"moe.top_k ({self.top_k}) is more than moe.num_experts ({self.num_experts})")
        if self.mlp_kind not in ACTIVATIONS:
            raise ConfigError(f"moe.mlp_kind must be one of {sorted(ACTIVATIONS)}, got {self.mlp_kind!r}")
        if self.dispatch not in DISPATCHES:
            raise ConfigError(f"moe.dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ConfigError(f"moe.grouped_matmul must be one of {GROUPED_MATMULS}, got {self.grouped_matmul!r}")
        if self.shared_expert_hidden < 0:
            raise ConfigError(f"moe.shared_expert_hidden must be zero (none) or positive, "
                              f"got {self.shared_expert_hidden}")
        if self.shared_expert_gate and not self.shared_expert_hidden:
            raise ConfigError("moe.shared_expert_gate needs shared experts (moe.shared_expert_hidden > 0)")

    @property
    def gated(self) -> bool:
        return self.mlp_kind in GATED


def check_expert_sharding(num_experts: int, mesh, rules=DEFAULT_RULES) -> None:
    """ConfigError when the mesh axes the "expert" rule names do not divide the expert count.

    `mesh` is a Mesh, an AbstractMesh or {axis: size}. The generic sharding code would replicate
    the expert axis instead (and split the experts' embed axis, FSDP-style): silently a different
    parallelism and communication pattern, so it is refused.
    """
    sizes = dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)
    axes = [a for a in rules.get(names.EXPERT, ()) if sizes.get(a, 1) > 1]
    ways = int(np.prod([sizes[a] for a in axes])) if axes else 1
    if num_experts % ways:
        raise ConfigError(f"moe: the expert axis is split over {' x '.join(f'mesh.{a}={sizes[a]}' for a in axes)}"
                          f" = {ways}, which does not divide num_experts ({num_experts})")


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        ex = cfg.execution
        init = normal(ex.init_std)
        e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_hidden
        self.router = Router(d, e, param_dtype=ex.parameter_dtype, init_std=ex.init_std, rngs=rngs)
        self.w_up = param(rngs, init, (e, d, f), moe_dispatch.EXPERT_IN_AXES, ex.parameter_dtype)
        self.w_gate = (param(rngs, init, (e, d, f), moe_dispatch.EXPERT_IN_AXES, ex.parameter_dtype)
                       if cfg.gated else None)
        self.w_down = param(rngs, init, (e, f, d), moe_dispatch.EXPERT_OUT_AXES, ex.parameter_dtype)
        self.shared = (MLP(d, cfg.shared_expert_hidden, kind=cfg.mlp_kind, dtype=ex.compute_dtype,
                           param_dtype=ex.parameter_dtype, init_std=ex.init_std, rngs=rngs)
                       if cfg.shared_expert_hidden else None)
        self.w_shared_gate = (param(rngs, init, (d, 1), (names.EMBED, names.NORM), ex.parameter_dtype)
                              if cfg.shared_expert_gate else None)

    def expert_weights(self) -> moe_dispatch.ExpertWeights:
        """The layer's expert weights in the compute dtype, each with its LoRA adapters merged in (if any:
        layers/lora.py ExpertLoraAdapter), so every dispatch runs them unchanged."""
        dtype = self.cfg.execution.compute_dtype

        def weight(name):
            w = getattr(self, name)
            return None if w is None else lora.merged_expert_weight(self, name, w[...].astype(dtype))
        return moe_dispatch.ExpertWeights(weight("w_up"), weight("w_down"), weight("w_gate"))

    def _grouped_matmul(self):
        if self.cfg.grouped_matmul == "ragged_dot":
            return jax.lax.ragged_dot
        return functools.partial(blocked_grouped_matmul, block=self.cfg.grouped_matmul_block)

    def apply(self, x_btd: jax.Array) -> tuple[jax.Array, RouterStats]:
        """(output [b, t, d] in the compute dtype, this call's RouterStats)."""
        cfg = self.cfg
        active = current_activation_mesh()
        if active is not None:
            check_expert_sharding(cfg.num_experts, active[0], active[1])
        x_btd = x_btd.astype(cfg.execution.compute_dtype)
        routing = route(self.router(x_btd), cfg.top_k, cfg.renormalize)
        act = ACTIVATIONS[cfg.mlp_kind]
        if cfg.dispatch == "dropless":
            y_btd, dropped = moe_dispatch.dropless(x_btd, routing.expert_index, routing.weight,
                                                   self.expert_weights(), act, self._grouped_matmul())
        else:
            y_btd, dropped = moe_dispatch.capacity(x_btd, routing.expert_index, routing.weight,
                                                   self.expert_weights(), act, cfg.capacity_factor)
        if self.shared is not None:
            shared_btd = self.shared(x_btd)
            if self.w_shared_gate is not None:
                gate_bt1 = x_btd @ self.w_shared_gate[...].astype(x_btd.dtype)
                shared_btd = jax.nn.sigmoid(gate_bt1) * shared_btd
            y_btd = y_btd + shared_btd
        return y_btd, router_stats(routing, dropped)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        """The output; the RouterStats go to the auxiliary-output collector in force (if any)."""
        y_btd, stats = self.apply(x_btd)
        aux_outputs.emit(self.cfg.aux_key, stats)
        return y_btd
