"""How the optimizer treats each parameter: a `LeafLayout` per leaf, read from the parameters' metadata.

Where a leaf's state lives, whether weight decay applies and whether it keeps
an fp32 master copy are decided per parameter; `make_layouts` reads the
metadata layers attach (layers/params.py): `logical_axes` (a leading "layers"
axis means stacked), an optional `optimizer_memory` override, and
`weight_decay` (False on norms, biases and embeddings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spillway.layers import names
from spillway.layers.errors import ConfigError
from spillway.layers.memory import MEMORIES, Memory
from spillway.layers.residency import is_split, parse_split
from spillway.layers.sharding import DEFAULT_RULES
from spillway.recipes.optim.config import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How the optimizer treats one parameter leaf."""
    stacked: bool        # leading axis is the layer axis (scanned blocks): stream it a layer at a time
    state_memory: str    # "device" | "host", already resolved (metadata override or config default)
    decay: bool          # weight decay applies
    master: bool = False  # keep an fp32 master copy (low-precision params with cfg.master_weights)
    # Non-stacked host leaves: the axis to stream the update along in pieces
    # of rows (one the parameter's sharding does not split); None: one piece.
    stream_axis: int | None = None
    # Stacked leaves with a split state (offload.optimizer_state=host:N, layers/residency.py): how many of
    # the last layers' state lives in host memory (0 < host_layers < layers; state_memory is then "host").
    # None: the whole leaf's state is in state_memory.
    host_layers: int | None = None

    def __post_init__(self):
        if self.state_memory not in MEMORIES:
            raise ValueError(f"LeafLayout.state_memory must be one of {MEMORIES}, got {self.state_memory!r}")
        if self.host_layers is not None and not (self.stacked and self.state_memory == Memory.HOST
                                                 and self.host_layers > 0):
            raise ValueError("LeafLayout.host_layers needs a stacked leaf with host state and at least one host "
                             f"layer, got {self}")

    @property
    def split(self) -> bool:
        """Whether the state is split: the first layers' in HBM, the last `host_layers`' in host memory."""
        return self.host_layers is not None



def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def rank_decay(logical_axes: tuple | None, shape: tuple[int, ...], stacked: bool) -> bool:
    """The fallback for parameters whose metadata does not say: decay matrices; not vectors (norms,
    biases) or vocab-first tables (embeddings)."""
    per_layer_ndim = len(shape) - (1 if stacked else 0)
    if per_layer_ndim < 2:
        return False
    return not (logical_axes and logical_axes[0] == names.VOCAB)


def _stream_axis(logical_axes: tuple | None, shape: tuple[int, ...]) -> int | None:
    """Axis to stream a non-stacked leaf's update along: the largest one FSDP does not shard.

    A dynamic slice along a sharded axis would make XLA gather the leaf; the
    fsdp mesh axis shards weights on their embed axis, so the vocabulary axis
    of an embedding or head is the one to cut. Vectors: None (one piece).
    """
    if len(shape) < 2:
        return None
    axes = logical_axes or (None,) * len(shape)
    allowed = [i for i, name in enumerate(axes) if "fsdp" not in DEFAULT_RULES.get(name, ())]
    return max(allowed, key=lambda i: shape[i]) if allowed else None


def keeps_master_copy(cfg: OptimizerConfig, dtype) -> bool:
    """Whether a parameter of `dtype` gets an fp32 master copy in the optimizer state: low precision only."""
    return cfg.master_weights and jnp.dtype(dtype) != jnp.float32


def make_layouts(params, cfg: OptimizerConfig, *, state_memory: str = Memory.DEVICE,
                 decay_fn: Callable[[tuple | None, tuple[int, ...], bool], bool] | None = None,
                 memory_fn: Callable[[str, Any], str | None] | None = None):
    """A LeafLayout per parameter of `params` (an nnx.State, or a plain tree of arrays).

    stacked: the parameter's logical_axes start with "layers". state_memory: a
    `memory_fn(path, leaf)` result if given and not None, else the parameter's
    `optimizer_memory` metadata, else `state_memory` (a recipe passes its
    offload.optimizer_state). decay: `decay_fn(logical_axes, shape, stacked)`
    when given; by default the parameter's `weight_decay` metadata (layers set
    False on norms, biases and embedding tables, layers/params.py), else
    `rank_decay`. Metadata comes first because shape cannot tell a 2-D bias
    ([heads, head_dim] q/k/v biases) from a matrix. master: cfg.master_weights
    and the parameter is not float32.
    """
    if is_split(state_memory):
        parse_split(state_memory, "offload.optimizer_state")
    elif state_memory not in MEMORIES:
        raise ConfigError(f"state_memory must be one of {MEMORIES} or a split host:N / host:F, got {state_memory!r}")

    def one(path, leaf):
        metadata = leaf.get_metadata() if _is_variable(leaf) else {}
        value = leaf.get_value() if _is_variable(leaf) else leaf
        axes = metadata.get("logical_axes")
        axes = tuple(axes) if axes is not None else None
        stacked = bool(axes) and axes[0] == names.LAYERS
        memory = (memory_fn(jax.tree_util.keystr(path), leaf) if memory_fn else None) \
            or metadata.get("optimizer_memory") or state_memory
        memory, host_layers = _resolve_split(memory, value.shape, stacked, jax.tree_util.keystr(path))
        if decay_fn is not None:
            decay = decay_fn(axes, tuple(value.shape), stacked)
        elif metadata.get("weight_decay") is not None:
            decay = metadata["weight_decay"]
        else:
            decay = rank_decay(axes, tuple(value.shape), stacked)
        return LeafLayout(stacked=stacked, state_memory=memory, decay=bool(decay),
                          master=keeps_master_copy(cfg, value.dtype),
                          stream_axis=None if stacked else _stream_axis(axes, tuple(value.shape)),
                          host_layers=host_layers)

    layouts = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)
    if is_split(state_memory) and not any(x.stacked for x in jax.tree.leaves(
            layouts, is_leaf=lambda x: isinstance(x, LeafLayout))):
        raise ConfigError(f"offload.optimizer_state={state_memory}: a split places block layers, and this model "
                          "has no stacked block weights (a leading 'layers' axis): use 'device' or 'host'")
    return layouts


def _resolve_split(memory: str, shape, stacked: bool, path: str) -> tuple[str, int | None]:
    """(state_memory, host_layers) of one leaf under a placement that may be a split (layers/residency.py).

    A split puts the last N layers of a stacked leaf on host; a non-stacked leaf (embedding, final norm,
    head) keeps its state in HBM, which a split is for. All or none of a leaf's layers: no split left."""
    if not is_split(memory):
        return memory, None
    if not stacked:
        return Memory.DEVICE, None
    layers = shape[0]
    count = parse_split(memory, "offload.optimizer_state").host_layers(layers)
    if count > layers:
        raise ConfigError(f"offload.optimizer_state={memory}: {path} has {layers} layers; a split may put 0 to "
                          f"{layers} of them on host")
    if count == 0:
        return Memory.DEVICE, None
    return Memory.HOST, (count if count < layers else None)


def normalized_paths(tree, is_leaf=None) -> list[str]:
    # nnx.Variable nodes add a `.value` step to leaf paths; layouts built over
    # Variables do not have it. Drop it so both spellings of one tree match.
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        keys = [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
        paths.append(jax.tree_util.keystr(tuple(keys)))
    return paths
