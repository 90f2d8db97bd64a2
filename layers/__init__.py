"""spillway's building blocks and the offload contract.

    names         checkpoint-name tags every block uses, logical axis names
    offload       OffloadPolicy (device | host | recompute per name), presets, RematPlan segments
    sharding      logical-axis rules, meshes, sharded creation
    norm, rope, attention, flash_attention, mlp, embed   one layer each
    block         TransformerBlock: the offload-aware base users subclass
    stack         BlockStack: stacked init, scan, remat/offload from outside
"""

from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.offload import PRESETS, OffloadPolicy, Placement, RematPlan, Segment, preset
from spillway.layers.stack import BlockStack

__all__ = ["BlockConfig", "BlockContext", "BlockStack", "OffloadPolicy", "PRESETS", "Placement", "RematPlan",
           "Segment", "TransformerBlock", "preset"]
