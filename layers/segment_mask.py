"""Packed examples that do not see each other: segment ids through every attention implementation.

A row packing several examples carries each token's example id (`segment_ids_bt`, recipes/train/sft_batch.py);
a query sees a key only when both belong to the same example and the key is not after it. The positions the
model is given restart at 0 with each example (RoPE); the mask itself is built on token indices, which order
the tokens of one example as their positions do, so a sliding window counts the same tokens either way.

What each `execution.attention_impl` does with segment ids:

    flash   the blockwise kernel takes them (layers/flash_attention.py): the mask per block, and key blocks
            whose examples no query of the block belongs to are skipped;
    xla     an explicit [b, 1, t, s] mask, causal and same-example (and the sliding window, the soft-cap path
            alike: layers/attention_reference.py);
    cudnn   refused by name (`check_segment_support`): jax.nn.dot_product_attention's cuDNN path takes no
            segment ids (only sequence lengths, or a dense bias that would cost the memory cuDNN is for).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spillway.layers.attention_reference import causal_mask
from spillway.layers.errors import ConfigError

SEGMENT_IMPLS = ("flash", "xla")


def check_segment_support(attention_impl: str) -> None:
    """ConfigError naming an attention implementation that cannot keep packed examples apart."""
    if attention_impl not in SEGMENT_IMPLS:
        raise ConfigError(f"execution.attention_impl={attention_impl} cannot keep packed examples apart "
                          f"(data.document_mask): jax's cuDNN attention takes no segment ids; set "
                          f"execution.attention_impl=flash (the same memory, in JAX) or xla, or "
                          f"data.document_mask=false")


def segment_causal_mask(segment_ids_bt: jax.Array, sliding_window) -> jax.Array:
    """[b, 1, t, t] visibility: causal on token indices, within the sliding window, same example only."""
    b, t = segment_ids_bt.shape
    index_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    same_b1ts = (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]
    return causal_mask(index_bt, index_bt, sliding_window) & same_b1ts
