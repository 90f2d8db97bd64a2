"""spillway's building blocks and the offload contract.

    names         checkpoint-name tags every block uses, logical axis names
    errors        SpillwayError (every failure a user can fix), ConfigError, DataError
    offload       OffloadPolicy (device | host | recompute per name), presets, RematPlan segments
    sharding      logical-axis rules, meshes, sharded creation
    norm, rope, attention, flash_attention, mlp, embed   one layer each
    block         TransformerBlock: the offload-aware base users subclass
    layer_values  LayerValues: per-layer traced window, RoPE base and scale
    stack         BlockStack: stacked init, scan, remat/offload from outside
    moe, router, moe_dispatch, moe_block, moe_flops   the mixture-of-experts layer (docs/DESIGN.md section 12)
    aux_outputs   the channel that carries auxiliary outputs (router statistics) out of a block stack

The names below are imported on first use (PEP 562), not with the package:
`spillway.data` imports `spillway.layers.errors`, and that must not start JAX.
"""

import importlib

_EXPORTS = {
    "BlockConfig": "block", "BlockContext": "block", "TransformerBlock": "block",
    "PRESETS": "offload", "OffloadPolicy": "offload", "Placement": "offload", "RematPlan": "offload",
    "Segment": "offload", "preset": "offload",
    "BlockStack": "stack", "LayerValues": "layer_values",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
