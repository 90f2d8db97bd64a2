"""Where each parameter lives (offload.params), and the gradient maths that must follow it there.

`offload.params=host` keeps the stacked block weights (leading "layers"
axis) in pinned host memory: the scan brings them into HBM a layer at a time
(layers/host_weights.py), their gradients come back to host memory layer by
layer, and the optimizer updates them there (its state must be on host too,
recipes/config.py). Embedding, final norm and head stay on device in this
version. `offload.params=experts` keeps only the routed experts' stacked
weights on host (layers/host_weights.py `is_expert_weight`): attention, norms,
router and shared experts stay in HBM, and the same stream carries the
experts. A parameter's `param_memory` metadata ("host" | "device") overrides
the setting for that leaf; only stacked leaves may be host-resident, because
only the scan streams them.

With gradient accumulation, host gradients are summed inside the backward
pass a layer at a time (recipes/train/step.py, layers/host_weights.py), so HBM
never holds the whole gradient.
"""

from __future__ import annotations

import jax
from flax import nnx

from spillway.layers import names
from spillway.layers.errors import ConfigError
from spillway.layers.host_weights import is_expert_weight, stacked_weight_memory
from spillway.layers.memory import EXPERTS, MEMORIES, PINNED_HOST, Memory
from spillway.recipes.optim.host_memory import host_memory_available, host_sharding


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_memories(state, setting: str):
    """"host" or "device" per parameter of an nnx.State (Variables at the leaves), from `setting` and metadata.

    Raises ConfigError for `setting` "experts" on a model without routed expert weights (it would place
    nothing on host, silently).
    """
    if setting == EXPERTS and not any(
            is_expert_weight(var.get_metadata().get("logical_axes"))
            for var in jax.tree.leaves(state, is_leaf=_is_variable) if _is_variable(var)):
        raise ConfigError("offload.params=experts, but the model has no MoE block (no routed expert weights "
                          "to place on host): use offload.params=host or device")
    def one(path, var):
        metadata = var.get_metadata()
        axes = tuple(metadata.get("logical_axes") or ())
        stacked = bool(axes) and axes[0] == names.LAYERS
        memory = stacked_weight_memory(metadata, setting) if stacked else metadata.get("param_memory") or Memory.DEVICE
        if memory not in MEMORIES:
            raise ConfigError(f"param_memory of {jax.tree_util.keystr(path)} must be 'host' or 'device', "
                              f"got {memory!r}")
        if memory == Memory.HOST and not stacked:
            raise ConfigError(f"parameter {jax.tree_util.keystr(path)} asks for host memory, but only stacked "
                              f"block weights (a leading 'layers' axis) can live on host")
        return memory
    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def placed_shardings(state, shardings, setting: str):
    """`shardings` (a tree like `state`) with pinned_host memory for the host-resident parameters.

    Raises ConfigError when a parameter is to live on host and the platform has no pinned host memory.
    """
    memories = param_memories(state, setting)
    on_host = [m == Memory.HOST for m in jax.tree.leaves(memories)]
    if any(on_host) and not host_memory_available():
        raise ConfigError(f"offload.params={setting}, but the {jax.default_backend()} platform exposes no "
                          f"'{PINNED_HOST}' memory: set offload.params=device")

    def one(memory, sharding):
        if memory != Memory.HOST:
            return sharding
        if _is_variable(sharding):   # nnx.State of shardings: Variables holding them
            return sharding.replace(host_sharding(sharding.get_value()))
        return host_sharding(sharding)
    return jax.tree.map(one, memories, shardings, is_leaf=_is_variable)


def any_host_sharding(shardings) -> bool:
    return any(getattr(s, "memory_kind", None) == PINNED_HOST for s in jax.tree.leaves(shardings))
