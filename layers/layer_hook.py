"""Work that runs right before each layer of the scanned block stack, inside the scan, with a carry.

A `LayerHook` put in force with `running_before_layers(hook)` while a model is
traced is called by BlockStack (layers/stack.py) in every iteration of its
scan, outside the layer's rematerialised body:

    carry = hook.start()                      before the first layer
    carry, layer_state, outputs = hook.before_layer(carry, t, layer_state)
                                              layer t then runs with the returned layer_state
    hook.collect(stacked outputs, carry)      once the scan is done (outputs stacked over the layers,
                                              the carry after the last layer)

A hook may have an attribute `resident_layers` = R > 0: the stack then runs
its first R layers in a scan of their own, calling
`hook.before_resident_layer(carry, t, layer_state)` (same signature, the
carry going on to the second scan), and `before_layer` only for layers R..L-1
(t counts the whole stack's layers in both; `collect` gets the outputs of
both scans joined). The deferred update with a split state uses it: its
resident layers' state is in HBM and needs no copy over the host link, and
one scan for both kinds would compile one body with the copies in it.

The carry lets the hook fetch what layer t+1 needs while layer t computes
(double buffering), and lets it update a buffer in place row by row (the
final carry comes back to it); the outputs come out of the scan stacked, a
new buffer of every output. Being outside the rematerialised
body, the hook's work is done once, in the forward pass, and never repeated
in the backward pass.

The train step's deferred optimizer update uses it
(recipes/optim/update_in_forward.py): layer t's update runs just before
layer t, its state's copies moving while the previous layer computes, the new
state written over the old in the carried buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp


class LayerHook(Protocol):
    def start(self) -> Any:
        """The carry before the first layer."""

    def before_layer(self, carry: Any, layer_index: Any, layer_state: Any) -> tuple[Any, Any, Any]:
        """(carry for the next layer, the layer state the layer runs with, this layer's outputs)."""

    def collect(self, outputs: Any, carry: Any) -> None:
        """Every layer's outputs, stacked along a leading layer axis, and the carry after the last layer."""


_HOOK: contextvars.ContextVar[LayerHook | None] = contextvars.ContextVar("spillway_layer_hook", default=None)


@contextlib.contextmanager
def running_before_layers(hook: LayerHook) -> Iterator[None]:
    """Models traced inside call `hook` before each layer of their block stack."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def current() -> LayerHook | None:
    """The hook in force, or None."""
    return _HOOK.get()


def scan_hooked_layers(hook, each_layer: Callable, carry: Any, rows: Any, num_layers: int) -> tuple[Any, list]:
    """The stack's layers in the scans `hook` asks for: with `resident_layers` = R > 0, layers [0, R) calling
    `before_resident_layer`, then [R, L) calling `before_layer`; else one scan calling `before_layer`.

    `rows`: a pytree of per-layer inputs stacked along a leading axis of `num_layers` (None leaves allowed);
    `each_layer(before, carry, layer_index, layer_rows)` -> (carry, outputs), `before` the hook method for
    that layer. Returns (the carry after the last layer, each scan's stacked outputs, in layer order). The
    block stack (layers/stack.py) and the deferred update's flush (recipes/optim/update_in_forward.py) both
    run their layers through it, so the two walk the layers alike.
    """
    resident = getattr(hook, "resident_layers", 0)
    scans = ([(hook.before_resident_layer, 0, resident)] if resident else []) + [(hook.before_layer, resident,
                                                                                   num_layers)]
    parts = []
    for before, start, stop in scans:
        carry, outputs = jax.lax.scan(lambda c, layer, before=before: each_layer(before, c, *layer), carry,
                                      (jnp.arange(start, stop), jax.tree.map(lambda a: a[start:stop], rows)))
        parts.append(outputs)
    return carry, parts


def join_layers(parts: list) -> Any:
    """Stacked outputs of consecutive scans joined along the layer axis."""
    return jax.tree.map(lambda *rows: jnp.concatenate(rows, axis=0), *parts)
