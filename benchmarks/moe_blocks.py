"""MoE blocks of fixed expert shapes that a recipe names by class path, for tests and benchmarks.

`--set block=benchmarks.moe_blocks:TinyMoEBlock` turns any family's block
into one whose MLP is an MoE layer (layers/moe.py): attention, norms and the
pre-norm forward are the family's, the experts are the class's. Until the MoE
families (Mixtral, Qwen3-MoE) give recipes their own, the host-resident expert
weight tests (tests/recipes/train/test_host_experts.py,
tests/recipes/plan/test_host_experts_aot.py), the auxiliary-loss and MoE
training tests (tests/recipes/train/test_aux_losses.py, test_moe_training.py)
and benchmarks/host_experts.py build their models this way.

Unlike `layers.moe_block.moe_block(cfg)`, the MoE layer takes d_model, the
activation kind and the execution (dtypes, init scale) from the block's own
config, so one class serves a model of any width and dtype; a class fixes the
expert count, top-k, expert hidden size and dispatch.
"""

from __future__ import annotations

from flax import nnx

from spillway.layers.block import TransformerBlock
from spillway.layers.moe import MoE, MoEConfig


class ExpertBlock(TransformerBlock):
    """A TransformerBlock whose MLP is `MoE(MoEConfig(d_model, mlp_kind and execution of the block,
    **moe_options))`."""

    moe_options: dict = {}

    def make_mlp(self, rngs: nnx.Rngs) -> nnx.Module:
        cfg = self.cfg
        return MoE(MoEConfig(d_model=cfg.d_model, mlp_kind=cfg.mlp_kind, execution=cfg.execution,
                             **self.moe_options), rngs=rngs)


# CPU-sized, odd: top-2 of 5 experts (a count no power-of-two bug hides behind), expert hidden 24.
TINY_EXPERTS = dict(num_experts=5, top_k=2, expert_hidden=24)


class TinyMoEBlock(ExpertBlock):
    """Dropless by `jax.lax.ragged_dot`."""
    moe_options = TINY_EXPERTS


class TinyMoEBlockedBlock(ExpertBlock):
    """Dropless by the blocked grouped matmul (blocks of 4 rows, so a tiny batch has several)."""
    moe_options = {**TINY_EXPERTS, "grouped_matmul": "blocked", "grouped_matmul_block": 4}


class TinyMoECapacityBlock(ExpertBlock):
    """Capacity dispatch at factor 1: some copies are dropped, the same ones wherever the weights live."""
    moe_options = {**TINY_EXPERTS, "dispatch": "capacity", "capacity_factor": 1.0}


# Top-2 of 4 experts: an expert count a mesh of fsdp 2 or 4 divides (the expert-sharded path).
_TINY_EVEN = dict(num_experts=4, top_k=2, expert_hidden=24)


class TinyEvenMoEBlock(ExpertBlock):
    moe_options = _TINY_EVEN


class TinyEvenMoEBlockedBlock(ExpertBlock):
    moe_options = {**_TINY_EVEN, "grouped_matmul": "blocked", "grouped_matmul_block": 4}


class TinyEvenMoECapacityBlock(ExpertBlock):
    moe_options = {**_TINY_EVEN, "dispatch": "capacity", "capacity_factor": 1.0}


# The deviceless compile tests' small scanned MoE: 8 experts, top-2, expert hidden 512.
_TOY = dict(num_experts=8, top_k=2, expert_hidden=512)


class ToyMoEBlock(ExpertBlock):
    moe_options = _TOY


class ToyMoEBlockedBlock(ExpertBlock):
    moe_options = {**_TOY, "grouped_matmul": "blocked"}


class ToyMoECapacityBlock(ExpertBlock):
    moe_options = {**_TOY, "dispatch": "capacity"}


# Qwen3-30B-A3B's experts (Hugging Face Qwen/Qwen3-30B-A3B config.json: num_experts 128,
# num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true).
_QWEN3_30B_A3B = dict(num_experts=128, top_k=8, expert_hidden=768, renormalize=True)


class Qwen3MoE30BBlock(ExpertBlock):
    moe_options = _QWEN3_30B_A3B


class Qwen3MoE30BBlockedBlock(ExpertBlock):
    moe_options = {**_QWEN3_30B_A3B, "grouped_matmul": "blocked"}


class Qwen3MoE30BCapacityBlock(ExpertBlock):
    moe_options = {**_QWEN3_30B_A3B, "dispatch": "capacity"}


# dispatch name (as benchmarks/moe_dispatch.py spells them) -> class name, per size
DISPATCH_BLOCKS = {
    "tiny": {"dropless": "TinyMoEBlock", "dropless_blocked": "TinyMoEBlockedBlock",
             "capacity": "TinyMoECapacityBlock"},
    "tiny_even": {"dropless": "TinyEvenMoEBlock", "dropless_blocked": "TinyEvenMoEBlockedBlock",
                  "capacity": "TinyEvenMoECapacityBlock"},
    "toy": {"dropless": "ToyMoEBlock", "dropless_blocked": "ToyMoEBlockedBlock", "capacity": "ToyMoECapacityBlock"},
    "qwen3_30b_a3b": {"dropless": "Qwen3MoE30BBlock", "dropless_blocked": "Qwen3MoE30BBlockedBlock",
                      "capacity": "Qwen3MoE30BCapacityBlock"},
}


def block_path(size: str, dispatch: str) -> str:
    """The `block=` value of a size's block with a dispatch."""
    return f"{__name__}:{DISPATCH_BLOCKS[size][dispatch]}"
