"""A channel that carries small auxiliary outputs (scalars, per-expert counts) out of a block and its stack.

A layer deep inside a block (an MoE layer in the MLP slot, say) has values the
training loss or the logs need: load-balancing statistics, a router z-loss, a
dropped-token count. Returning them would change every signature between the
layer and the loss (`TransformerBlock.forward` adds `self.mlp(h)` to the
residual and expects an array). Instead a layer *emits* them, and whoever
opened a collector around the call receives them as a dict:

    with aux_outputs.collecting() as aux:      # the loss function, or a scan body
        y = model(x)                           # a layer calls aux_outputs.emit("moe", stats)
    aux.values                                 # {"moe": stats}

Rules that keep it safe under JAX's transformations:

- A value is emitted and collected within one trace: open the collector in the
  same function that returns the values (a scan body returns them as its
  outputs; a loss function returns them as its `has_aux` output). Emitting
  inside a nested transform of the layer's own (a vmap, a shard_map) would leak
  a tracer: emit at the block's level.
- One emit per key per collector; a second is an error (two layers of one
  block emitting under one key would silently overwrite each other).
- With no collector open, `emit` drops the value. A standalone call of a layer
  (tests, abstract tracing) then costs nothing; a block stack always collects.

How a scanned stack threads it (layers/stack.py does this):

    body = aux_outputs.collected_in_body(body)           # (x, xs) -> (x, (ys, aux)) per layer
    x, (ys, aux_l) = jax.lax.scan(body, x, xs)           # aux_l: every leaf stacked [layers, ...]
    ...one aux_l per segment (or run) of the stack...
    aux_outputs.emit_all(aux_outputs.concat_layers(per_segment))   # up to the model's collector

The wrapper goes inside `jax.checkpoint` (the body is rematerialised as a
whole; the aux values are ordinary outputs of it, so remat and offload
policies apply to the block unchanged). Reductions over layers are the
consumer's (e.g. `layers.router.load_balancing_loss` sums its statistics over
every leading axis, which pools the layers as Hugging Face's Mixtral does).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp


class AuxCollector:
    """What one `collecting()` block received: `values`, a dict of key -> pytree."""

    def __init__(self):
        self.values: dict[str, Any] = {}

    def add(self, key: str, value: Any) -> None:
        if key in self.values:
            raise ValueError(f"auxiliary output {key!r} emitted twice into one collector; "
                             f"give each layer of a block its own key")
        self.values[key] = value


_COLLECTOR: contextvars.ContextVar[AuxCollector | None] = contextvars.ContextVar(
    "spillway_aux_collector", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[AuxCollector]:
    """Collect what is emitted inside; an enclosing collector receives nothing of it."""
    collector = AuxCollector()
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)


# The names a train step's own metrics take in metrics.jsonl and TensorBoard, where emitted values are logged
# beside them under their keys (recipes/train/loop_parts.py): an emitted "loss" overwrote the loss logged, an
# emitted "step" the row's step (a resume then dropped rows).
RESERVED_KEYS = frozenset({"step", "loss", "grad_norm", "learning_rate", "tokens_per_s", "step_time_s", "mfu",
                           "memory_gib", "val_loss"})
RESERVED_PREFIXES = ("tokens/", "val_loss/")


def emit(key: str, value: Any) -> None:
    """Hand `value` (a pytree of arrays) to the collector in force; dropped when none is."""
    if not isinstance(key, str) or key in RESERVED_KEYS or key.startswith(RESERVED_PREFIXES):
        raise ValueError(f"auxiliary output {key!r}: a key is a string other than the run's own metric names "
                         f"({', '.join(sorted(RESERVED_KEYS))}, tokens/..., val_loss/...); emit it under a name of "
                         f"the block's, such as 'myblock/{key}'")
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.add(key, value)


def emit_all(values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        emit(key, value)


def active() -> bool:
    """Whether anything would receive an emitted value (a layer may skip computing unwanted statistics)."""
    return _COLLECTOR.get() is not None


def collected_in_body(body: Callable) -> Callable:
    """A scan body (carry, xs) -> (carry, ys) made to return (carry, (ys, aux dict of what it emitted))."""

    def wrapped(carry, xs):
        with collecting() as aux:
            carry, ys = body(carry, xs)
        return carry, (ys, aux.values)

    return wrapped


def concat_layers(per_segment: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The per-segment (or per-run) stacked aux dicts of one stack joined along the layer axis.

    Runs of different block kinds may emit different keys (a dense run among sparse ones emits no
    router statistics), so each key is joined over the segments that carry it, in layer order.
    """
    keys: list[str] = []
    for values in per_segment:
        keys += [k for k in values if k not in keys]
    joined = {}
    for key in keys:
        parts = [values[key] for values in per_segment if key in values]
        joined[key] = parts[0] if len(parts) == 1 else jax.tree.map(
            lambda *leaves: jnp.concatenate(leaves, axis=0), *parts)
    return joined


def sum_layers(values: Any) -> Any:
    """Every leaf of a stacked aux pytree summed over its leading (layer) axis."""
    return jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), values)
