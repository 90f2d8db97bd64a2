"""A saved leaf held in parts: `RowPieces` (an array, or consecutive row blocks such as LayerHalves' two halves,
never joined), the state's LayerHalves / ResidentSplit seen as such (`as_pieces`, `restore_target`) and back
(`from_pieces`), and the join orbax's whole save needs (`joined`). Shared by the piece-wise writes
(checkpoint_io.py) and reads (checkpoint_read.py)."""

from __future__ import annotations

import dataclasses
import math

import jax


@dataclasses.dataclass(frozen=True)
class RowPieces:
    """One saved leaf, shape (rows, ...), held as `parts`: arrays whose rows follow each other (no copy made).

    A pytree leaf (not a node), so orbax sees one array of `shape` and hands it to PieceWiseArrayHandler."""

    parts: tuple[jax.Array, ...]

    def __post_init__(self):
        first = self.parts[0]
        for part in self.parts[1:]:
            if part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
                raise ValueError(f"RowPieces: parts {[p.shape for p in self.parts]} do not stack along rows")

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        if first.ndim == 0:
            return ()
        return (sum(p.shape[0] for p in self.parts), *first.shape[1:])

    @property
    def dtype(self):
        return self.parts[0].dtype

    @property
    def sharding(self):
        return self.parts[0].sharding   # the parts share one sharding (LayerHalves' halves do)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def delete(self) -> None:
        for part in self.parts:
            part.delete()


def is_saved_leaf(x) -> bool:
    from spillway.recipes.optim.host_streaming import LayerHalves
    from spillway.recipes.optim.split_state import ResidentSplit
    return isinstance(x, (RowPieces, LayerHalves, ResidentSplit))


def row_parts(x) -> tuple | None:
    """The arrays whose rows make up one saved leaf, in row order, or None for a plain leaf: a LayerHalves'
    two halves; a ResidentSplit's (offload.optimizer_state=host:N) device rows, then its host rows."""
    from spillway.recipes.optim.host_streaming import LayerHalves
    from spillway.recipes.optim.split_state import ResidentSplit
    if isinstance(x, LayerHalves):
        return (x.first, x.second)
    if isinstance(x, ResidentSplit):
        return (x.device, *(row_parts(x.host) or (x.host,)))
    return getattr(x, "parts", None)


def as_pieces(tree):
    """`tree` with every jax.Array leaf wrapped as a one-part RowPieces and every LayerHalves (a host state
    leaf kept as two buffers) as a two-part one: the tree `Optimizer.saved_form` would make, nothing copied."""
    def wrap(x):
        parts = row_parts(x)
        if parts is not None:
            return RowPieces(tuple(parts))
        return RowPieces((x,)) if isinstance(x, jax.Array) else x
    return jax.tree.map(wrap, tree, is_leaf=is_saved_leaf)


def joined(tree):
    """`tree` with every LayerHalves or RowPieces leaf as one array (a copy, by the host CPU): orbax's default
    path takes jax.Arrays only. For an optimizer state, what `Optimizer.saved_form` returns."""
    from spillway.recipes.optim.host_streaming import LayerHalves, join_halves
    from spillway.recipes.optim.split_state import ResidentSplit, join_split

    def join(x):
        if isinstance(x, ResidentSplit):
            return join_split(x)   # the device rows copied out, then one host array
        parts = row_parts(x)
        if parts is None:
            return x
        if len(parts) == 1:
            return parts[0]
        if len(parts) == 2:
            return join_halves(LayerHalves(*parts))
        raise ValueError(f"RowPieces of {len(parts)} parts: only one or two are joined")
    return jax.tree.map(join, tree, is_leaf=is_saved_leaf)


def restore_target(tree, struct):
    """A restore target with every LayerHalves or ResidentSplit (of ShapeDtypeStructs or arrays) as a RowPieces
    of its parts, each leaf or part made a ShapeDtypeStruct by `struct`: the saved array is read straight
    into those parts (checkpoint_read.py)."""
    def one(path, x):
        parts = row_parts(x)
        if parts is not None:
            return RowPieces(tuple(struct(path, p) for p in parts))
        return struct(path, x)
    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_saved_leaf)


def from_pieces(template, restored):
    """`restored` (restored into `restore_target(template)`) in the form of `template`: each RowPieces of
    parts regrouped as the LayerHalves or ResidentSplit the template holds there (nothing copied)."""
    from spillway.recipes.optim.host_streaming import LayerHalves
    from spillway.recipes.optim.split_state import ResidentSplit

    def regroup(form, value):
        if isinstance(form, LayerHalves):
            return LayerHalves(*value.parts)
        if isinstance(form, ResidentSplit):
            device, *host = value.parts
            return ResidentSplit(device, LayerHalves(*host) if isinstance(form.host, LayerHalves) else host[0])
        return value
    return jax.tree.map(regroup, template, restored, is_leaf=is_saved_leaf)
