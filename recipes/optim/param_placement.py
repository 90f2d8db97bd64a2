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

A split (`offload.params=host:N` or `experts:N`, layers/residency.py) keeps those weights of the last N block
layers on host and the first L - N in HBM: such a leaf's value is a `ResidentSplit` (recipes/optim/split_state.py)
of a device array (layers [0, L - N)) and a host array (the rest). The block stack cuts its scans at that
layer (layers/stack.py), so only the host layers are streamed; the optimizer updates each part where its
state is. Checkpoints hold the whole leaf, one stored array, written from the two parts a piece at a time
(recipes/train/checkpoint_io.py), so a run restores under any split; `saved_params` is that leaf joined in
memory (orbax's whole save, comparisons).

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
from spillway.layers.residency import host_layers, is_param_split, whole_placement
from spillway.recipes.optim.host_memory import host_memory_available, host_sharding
from spillway.recipes.optim.split_state import ResidentSplit


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_memories(state, setting: str):
    """"host" or "device" per parameter of an nnx.State (Variables at the leaves), from `setting` and metadata.
    A split setting (host:N, experts:N) answers for the leaves whose host layers it places: "host".

    Raises ConfigError for `setting` "experts" on a model without routed expert weights (it would place
    nothing on host, silently).
    """
    setting = whole_placement(setting)
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
    if is_param_split(setting):
        memories = _split_memories(state, memories, setting)
    on_host = [m == Memory.HOST for m in jax.tree.leaves(memories)]
    if any(on_host) and not host_memory_available():
        raise ConfigError(f"offload.params={setting}, but the {jax.default_backend()} platform exposes no "
                          f"'{PINNED_HOST}' memory: set offload.params=device")

    def one(memory, sharding):
        if memory == Memory.DEVICE:
            return sharding
        inner = sharding.get_value() if _is_variable(sharding) else sharding
        placed = host_sharding(inner) if memory == Memory.HOST else ResidentSplit(inner, host_sharding(inner))
        return sharding.replace(placed) if _is_variable(sharding) else placed   # nnx.State: Variables hold them
    return jax.tree.map(one, memories, shardings, is_leaf=_is_variable)


SPLIT = "split"   # a leaf's memory under a split setting whose host layers are some, not all, of its layers


def _split_memories(state, memories, setting: str):
    """`memories` with "split" for the host leaves whose layers a split setting puts partly on host
    ("device" where it puts none of them there)."""
    def one(var, memory):
        if memory != Memory.HOST:
            return memory
        layers = var.get_value().shape[0]
        count = host_layers(setting, layers)
        return Memory.DEVICE if count == 0 else Memory.HOST if count == layers else SPLIT
    return jax.tree.map(one, state, memories, is_leaf=_is_variable)


def any_host_sharding(shardings) -> bool:
    return any(getattr(s, "memory_kind", None) == PINNED_HOST for s in jax.tree.leaves(shardings))


def _is_split(x) -> bool:
    return isinstance(x, ResidentSplit)


def any_split(tree) -> bool:
    """Whether any parameter of `tree` (values, shardings or structs) is a ResidentSplit."""
    return any(_is_split(x) for x in jax.tree.leaves(tree, is_leaf=_is_split))


def whole_shardings(shardings):
    """Param shardings with each split leaf's sharding as the whole leaf's: its host part's (host memory).
    The shardings a checkpoint's params are saved and restored in (`saved_params`)."""
    return jax.tree.map(lambda s: s.host if _is_split(s) else s, shardings, is_leaf=_is_split)


def saved_params(params):
    """The params with every split leaf joined into one host array (recipes/optim/split_state.join_split):
    what a checkpoint holds, so that it restores under any split (of ShapeDtypeStructs: `saved_structs`).
    Unsplit params are returned as they are. Joining is a host copy of the split leaves: a save in pieces
    writes the parts without it (recipes/train/checkpoint_io.py); orbax's whole save joins them."""
    from spillway.recipes.optim.split_state import join_split
    if not any_split(params):
        return params
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return saved_structs(params)
    return jax.tree.map(lambda x: join_split(x) if _is_split(x) else x, params, is_leaf=_is_split)


def params_from_saved(saved, placed):
    """Inverse of `saved_params`: whole (restored) params cut, where `placed` (the run's params, or their
    ShapeDtypeStructs) has a split leaf, into its device rows and host rows by the host CPU. A leaf of
    `saved` already split (restored straight into the parts) is kept as it is."""
    from spillway.recipes.optim.split_state import split_saved
    if not any_split(placed):
        return saved

    def one(x, p):
        if _is_split(x) or not _is_split(p):
            return x
        return split_saved(x, x.shape[0] - p.device.shape[0], halved=False)
    return jax.tree.map(one, saved, placed, is_leaf=_is_split)


def saved_structs(placed):
    """ShapeDtypeStructs of what `saved_params` makes of params like `placed` (structs with shardings):
    each split leaf as one whole host array, in its host part's sharding. A checkpoint's restore target."""
    def one(x):
        if not _is_split(x):
            return x
        rows = x.device.shape[0] + x.host.shape[0]
        return jax.ShapeDtypeStruct((rows, *x.host.shape[1:]), x.host.dtype, sharding=x.host.sharding)
    return jax.tree.map(one, placed, is_leaf=_is_split)


def placed_structs(abstract_state, shardings, setting: str):
    """ShapeDtypeStructs of the params as a run places them: `abstract_state` (whole leaves) with
    `shardings` (placed_shardings of `setting`), each split leaf cut into a device struct and a host struct."""
    def one(a, s):
        if not _is_split(s):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        resident = a.shape[0] - host_layers(setting, a.shape[0])
        return ResidentSplit(jax.ShapeDtypeStruct((resident, *a.shape[1:]), a.dtype, sharding=s.device),
                             jax.ShapeDtypeStruct((a.shape[0] - resident, *a.shape[1:]), a.dtype, sharding=s.host))
    return jax.tree.map(one, abstract_state, shardings)
