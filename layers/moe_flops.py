"""Forward FLOPs of one MoE layer (layers/moe.py), counted from its config: what MFU and the planner need.

Each token goes through its top-k experts of E, so a layer's compute is k
experts' worth per token, not E: Qwen3-30B-A3B holds 128 experts a layer and
computes 8. Counted, 2 FLOPs per multiply-add:

    router         tokens x d x E
    expert_hidden  tokens x k x d x f, twice for a gated MLP (gate and up)
    expert_out     tokens x k x f x d
    shared_*       the shared experts' dense MLP on every token, and its sigmoid gate (d x 1)

`counted="active"` is the useful work (the figure MFU and the FLOP oracles
use, the same for both dispatches). `counted="executed"` is what the chosen
dispatch multiplies: the same for dropless by ragged_dot (as specified; XLA's
GPU lowering of it multiplies E times more, docs/DESIGN.md section 12); by
blocks, every row of the fixed block count, padding included; for the capacity
dispatch every slot, empty or not: E x capacity slots per sequence instead of
t x k copies.
Not counted, as in models/flops.py: elementwise work (softmax, top-k,
the activation, the combine) and the dispatch's sorts, gathers and scatters.
"""

from __future__ import annotations

import dataclasses

from spillway.layers.grouped_matmul import padded_blocks
from spillway.layers.moe import MoEConfig
from spillway.layers.moe_dispatch import expert_capacity

COUNTS = ("active", "executed")


@dataclasses.dataclass(frozen=True)
class MoELayerFlops:
    """Forward FLOPs of one MoE layer for a whole batch, by the product that makes them."""

    router: float
    expert_hidden: float    # gate and up projections of the routed copies
    expert_out: float       # down projection of the routed copies
    shared_hidden: float    # the shared experts' gate and up
    shared_out: float
    shared_gate: float

    @property
    def experts(self) -> float:
        return self.expert_hidden + self.expert_out

    @property
    def total(self) -> float:
        return self.router + self.experts + self.shared_hidden + self.shared_out + self.shared_gate


def moe_layer_flops(cfg: MoEConfig, batch: int, seq_len: int, *, counted: str = "active") -> MoELayerFlops:
    if counted not in COUNTS:
        raise ValueError(f"counted must be one of {COUNTS}, got {counted!r}")
    tokens = batch * seq_len
    d, f, fs = cfg.d_model, cfg.expert_hidden, cfg.shared_expert_hidden
    copies = tokens * cfg.top_k
    if counted == "executed" and cfg.dispatch == "capacity":
        copies = batch * cfg.num_experts * expert_capacity(seq_len, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
    elif counted == "executed" and cfg.grouped_matmul == "blocked":
        # The block loop runs over a fixed number of blocks, padding and trailing empty blocks included.
        copies = padded_blocks(copies, cfg.num_experts, cfg.grouped_matmul_block) * cfg.grouped_matmul_block
    matrices = 2 if cfg.gated else 1
    return MoELayerFlops(
        router=2.0 * tokens * d * cfg.num_experts,
        expert_hidden=2.0 * copies * d * f * matrices,
        expert_out=2.0 * copies * f * d,
        shared_hidden=2.0 * tokens * d * fs * matrices,
        shared_out=2.0 * tokens * fs * d,
        shared_gate=2.0 * tokens * d if cfg.shared_expert_gate else 0.0,
    )


def moe_flops_per_token(cfg: MoEConfig) -> float:
    """Active forward FLOPs of the layer per token."""
    return moe_layer_flops(cfg, 1, 1).total
