"""The optimizer update of host-resident state run inside the next step's forward pass (offload.update=next_forward).

Step t returns its gradients (`PendingUpdate`) instead of applying them;
step t+1 applies them, each block layer's just before that layer runs in its
forward pass, so the state's copies cross the link beside compute. Why, what
the compiled schedule does with it, and its limits: docs/DESIGN.md section 6.

    before the forward pass   the scalars (global norm, step count, learning rate) and the
                              update of every leaf outside the stacked blocks, or with its
                              state on device (Optimizer.begin; embedding, head, norms)
    layer t of the forward    layer t's state (prefetched while layer t-1 computed) and its
                              pending gradient make its new weight and new state; the new
                              state goes back to host memory; layer t runs with the new
                              weight; layer t+1's state is fetched meanwhile
                              (a layers.layer_hook.LayerHook, outside the remat body)

Same maths, in the same order, as the update at the end of step t. `flush`
(this hook run over the layers on its own, so that it rounds as the next step
would) applies what is still pending before a checkpoint, validation or the
end of training; a flushed `PendingUpdate` has
apply=False, and a step with nothing to apply leaves every value as it is
(adamw.adamw_piece selects). The stacked state is one host array per leaf
here (no LayerHalves), carried through the scan and written a row at a time in
place: iteration t writes layer t-1's new rows over its old ones, then reads
layer t+1's from the buffers written, and the step donates the state, so the
state is never in host memory twice (deviceless H200: its host bytes alias,
host temp 0; docs/DESIGN.md section 6). The pending gradients are donated too
(with keep_unused: recipes/train/step.py says why), the new ones written where the
old ones were.

Where the stacked leaves' pending gradients wait (offload.pending_gradients): in
pinned host memory (`pending_in_host_memory=True`, the default: each layer's
gradient leaves HBM as the backward pass makes it and comes back in the next
forward pass), or in HBM (False: about the HBM of the update after the backward
pass, which holds the whole stacked gradient then too; no gradient crosses the
link), where the backward pass writes each layer's new gradient over its row of
the old ones (`_into_layer_in_place`, below says why). The maths is the same
either way.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

from spillway.layers import layer_hook
from spillway.recipes.optim import host_streaming as streaming
from spillway.recipes.optim.host_memory import host_sharding
from spillway.recipes.optim.split_state import ResidentSplit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingUpdate:
    """The gradients of the last step, not yet applied: the stacked leaves' in host memory (or in HBM:
    `pending_shardings`), the rest on device; their global norm (float32 scalar) and whether there are any
    (a boolean scalar)."""
    grads: object
    grad_norm: jax.Array
    apply: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight", "grad_sink"], meta_fields=["key"])
@dataclasses.dataclass(frozen=True)
class _UpdatedBeforeUse:
    """A stacked weight (or its layer) standing in the model's state for the weight its layer will run
    with. `grad_sink`: the same layer of the pending gradient's host buffer, the input the step
    differentiates (its value is never read: the new gradient is what comes back for it); None with the
    pending gradients in HBM, whose stacked buffer rides in the hook's carry instead. `key`: the leaf's
    index in the optimizer's flattening."""
    weight: jax.Array
    grad_sink: jax.Array
    key: int


def _is_updated(x) -> bool:
    return isinstance(x, _UpdatedBeforeUse)


@jax.custom_vjp
def _into_layer(new_weight, grad_sink, norm_probe):
    """new_weight, for the layer to run with. Backward: the weight's gradient goes to host memory as the
    cotangent of `grad_sink` (the layer's gradient leaves HBM as the backward pass makes it), and its
    sum of squares on device as the cotangent of `norm_probe` (a scalar every layer shares, so the scan's
    transpose adds them up: the stacked gradients' squared norm, without reading them back)."""
    return new_weight


def _into_layer_fwd(new_weight, grad_sink, norm_probe):
    return new_weight, None


def _into_layer_bwd(_, grad):
    return None, streaming.to_host(grad), jnp.sum(jnp.square(grad.astype(jnp.float32)))


_into_layer.defvjp(_into_layer_fwd, _into_layer_bwd)


# Pending gradients in HBM (offload.pending_gradients=device). Had each layer's gradient come back as the
# cotangent of its own row, as above, the scan's transpose would stack the rows into a new buffer
# (zeros first), and XLA, which puts a donated argument's memory only under a value made from that argument,
# would copy that buffer into the old gradients' after the loop: old and new in HBM together (deviceless
# H200, Llama 3.2 1B: HBM 9.78 GiB against 6.33 with them on host). Instead the stacked pending gradient
# rides in the hook's carry, untouched by the forward pass, and its cotangent is seeded with the old
# gradients themselves (`_seeded_with_itself`); going back, each layer writes its gradient over its own
# row of that cotangent (`_into_layer_in_place`), so the new gradients are made in the old ones' buffer,
# a row at a time, as the carried state is in the forward pass. Every row is written once (every layer
# runs once), so what comes back is the new gradient whatever the seed held; no other operation reads
# the carried buffer's cotangent.

@jax.custom_vjp
def _into_layer_in_place(new_weight, stacked_sink, layer_index, norm_probe):
    """(new_weight, stacked_sink unchanged). Backward: the weight's gradient written over row `layer_index`
    of the stacked sink's cotangent (in place, in HBM), and its sum of squares as `norm_probe`'s."""
    return new_weight, stacked_sink


def _into_layer_in_place_fwd(new_weight, stacked_sink, layer_index, norm_probe):
    return (new_weight, stacked_sink), layer_index


def _into_layer_in_place_bwd(layer_index, cotangents):
    grad, sink_cotangent = cotangents
    written = lax.dynamic_update_index_in_dim(sink_cotangent, grad.astype(sink_cotangent.dtype), layer_index, 0)
    return None, written, None, jnp.sum(jnp.square(grad.astype(jnp.float32)))


_into_layer_in_place.defvjp(_into_layer_in_place_fwd, _into_layer_in_place_bwd)


@jax.custom_vjp
def _seeded_with_itself(stacked_sinks):
    """0.0, added to the loss. Backward: the sinks' cotangent is their own value (the old pending gradients):
    the buffer `_into_layer_in_place` writes each layer's new gradient into."""
    return jnp.zeros((), jnp.float32)


def _seeded_with_itself_fwd(stacked_sinks):
    return jnp.zeros((), jnp.float32), stacked_sinks


def _seeded_with_itself_bwd(stacked_sinks, _):
    return (stacked_sinks,)


_seeded_with_itself.defvjp(_seeded_with_itself_fwd, _seeded_with_itself_bwd)


class _UpdateBeforeEachLayer:
    """The LayerHook: layer t's update from its prefetched gradient and state, layer t+1's fetched meanwhile.

    Its carry: (the state's host buffers, written a row at a time in place; the resident layers' state
    buffers in HBM, likewise; the next layer's gradient and state rows on device; the rows to write next),
    and with the pending gradients in HBM their stacked buffers too (the sinks `_into_layer_in_place`
    threads through; `pending_grads` are then those, the differentiated ones). What it collects: per leaf
    (the new stacked weight, the new state: host buffers, or ResidentSplits of a split leaf's two), and
    the sinks after the last layer (`final_sinks`).

    A split state (offload.optimizer_state=host:N): the first `resident_layers` = L - N block layers keep
    their state in HBM. The stack runs them in a scan of their own (layers/layer_hook.py), where
    `before_resident_layer` updates each from its state rows in HBM (nothing crosses the host link); the
    host buffers hold the last N layers' rows (row t - resident_layers for layer t), the pending gradients
    every layer's (row t).
    """

    def __init__(self, begun, pending_grads: dict, norm_probe, pending_in_host_memory: bool = True):
        self.begun = begun
        self.pending_grads = pending_grads
        self.norm_probe = norm_probe
        self.pending_in_host_memory = pending_in_host_memory
        self.outputs = None
        self.final_sinks = None
        lengths = {state[0].shape[0] for state in begun.host_state.values()}
        if len(lengths) > 1:
            raise ValueError(f"offload.update=next_forward needs one stack of layers; the stacked leaves "
                             f"have {sorted(lengths)} layers")
        self.resident_layers = begun.resident_layers
        self.num_layers = lengths.pop() if lengths else 0   # the hooked (host) layers

    def _grad_row(self, k, layer_index, sinks):
        if self.pending_in_host_memory:
            return streaming.to_device(lax.dynamic_index_in_dim(self.pending_grads[k], layer_index, keepdims=False))
        # in HBM: read from the carried sink (not differentiated through: the update stops gradients)
        return lax.dynamic_index_in_dim(lax.stop_gradient(sinks[k]), layer_index, keepdims=False)

    def _fetch(self, buffers, layer_index, sinks=None):
        """Layer `layer_index`'s (a host layer: at or after resident_layers) pending gradient and state rows,
        on device."""
        def row(x):
            return streaming.to_device(lax.dynamic_index_in_dim(x, layer_index - self.resident_layers,
                                                                keepdims=False))
        return {k: (self._grad_row(k, layer_index, sinks), tuple(row(s) for s in state))
                for k, state in buffers.items()}

    def start(self):
        """(the host state buffers, written a row at a time in place; the resident layers' state buffers; the
        first host layer's gradient and state rows on device; the rows to write before the next fetch: that
        layer's own, unchanged, the first time), and with the pending gradients in HBM their stacked sinks."""
        buffers = dict(self.begun.host_state)
        sinks = None if self.pending_in_host_memory else dict(self.pending_grads)
        current = self._fetch(buffers, self.resident_layers, sinks)
        carry = (buffers, dict(self.begun.resident_state), current, {k: rows for k, (_, rows) in current.items()})
        return carry if sinks is None else (*carry, sinks)

    def _update(self, leaf, grad_row, state_rows, layer_index, sinks, new_weights, new_rows, dtypes):
        """Leaf's layer updated: its new weight (what the layer runs with, its gradient routed back) recorded
        in `new_weights`, its new state rows in `new_rows`."""
        new_weight, new_state = self.begun.layer_update[leaf.key](grad_row, leaf.weight, state_rows)
        new_weight = lax.stop_gradient(new_weight.astype(leaf.weight.dtype))
        new_weights[leaf.key] = new_weight
        new_rows[leaf.key] = tuple(lax.stop_gradient(d).astype(dtype) for d, dtype in zip(new_state, dtypes))
        if sinks is None:
            return _into_layer(new_weight, leaf.grad_sink, self.norm_probe)
        new_weight, sinks[leaf.key] = _into_layer_in_place(new_weight, sinks[leaf.key], layer_index, self.norm_probe)
        return new_weight

    def before_resident_layer(self, carry, layer_index, layer_state):
        """Before a resident layer (t < resident_layers): its update from its state rows in HBM, written back
        over them in place; the first host layer's rows, fetched by `start`, wait in the carry."""
        buffers, resident, current, previous, *sinks = carry
        sinks = dict(sinks[0]) if sinks else None
        new_weights, new_rows = {}, {}

        def update(leaf):
            if not _is_updated(leaf):
                return leaf
            state = resident[leaf.key]
            rows = tuple(lax.dynamic_index_in_dim(s, layer_index, keepdims=False) for s in state)
            return self._update(leaf, self._grad_row(leaf.key, layer_index, sinks), rows, layer_index, sinks,
                                new_weights, new_rows, [s.dtype for s in state])

        layer_state = jax.tree.map(update, layer_state, is_leaf=_is_updated)
        resident = {k: tuple(lax.dynamic_update_index_in_dim(s, new_rows[k][i], layer_index, 0)
                             for i, s in enumerate(state)) for k, state in resident.items()}
        carry = (buffers, resident, current, previous) + ((sinks,) if sinks is not None else ())
        return carry, layer_state, new_weights

    def before_layer(self, carry, layer_index, layer_state):
        buffers, resident, current, previous, *sinks = carry
        sinks = dict(sinks[0]) if sinks else None
        # The previous layer's new rows go over its old ones first (in place: the step donates the
        # state), and the next layer's are read from the buffers written: the read follows the write it
        # depends on, so XLA needs neither a copy nor an order of its own between them, and both copies
        # are free to run beside this layer's update and compute, which need neither.
        first, last = self.resident_layers, self.resident_layers + self.num_layers - 1
        buffers = {k: tuple(lax.dynamic_update_index_in_dim(s, streaming.to_host(previous[k][i]),
                                                            jnp.maximum(layer_index - 1, first) - first, 0)
                            for i, s in enumerate(state))
                   for k, state in buffers.items()}
        upcoming = self._fetch(buffers, jnp.minimum(layer_index + 1, last), sinks)
        new_weights, new_rows = {}, {}

        def update(leaf):
            if not _is_updated(leaf):
                return leaf
            grad_row, state_rows = current[leaf.key]
            return self._update(leaf, grad_row, state_rows, layer_index, sinks, new_weights, new_rows,
                                [s.dtype for s in buffers[leaf.key]])

        layer_state = jax.tree.map(update, layer_state, is_leaf=_is_updated)
        carry = (buffers, resident, upcoming, new_rows) + ((sinks,) if sinks is not None else ())
        return carry, layer_state, new_weights

    def collect(self, outputs, carry):
        """`outputs`: every layer's new weights, stacked over the whole stack (resident layers first)."""
        if self.outputs is not None:
            raise ValueError("offload.update=next_forward needs one stack of layers; a second one ran")
        buffers, resident, _, last, *sinks = carry
        self.final_sinks = sinks[0] if sinks else None
        last_layer = self.num_layers - 1

        def new_state(k):
            host = tuple(lax.dynamic_update_index_in_dim(s, streaming.to_host(last[k][i]), last_layer, 0)
                         for i, s in enumerate(buffers[k]))
            if k not in resident:
                return host
            return tuple(ResidentSplit(d, h) for d, h in zip(resident[k], host))
        self.outputs = {k: (outputs[k], new_state(k)) for k in outputs}


def make_train_step(objective, optimizer, pending_in_host_memory: bool = True):
    """(params, opt_state, pending, batch) -> (params, opt_state, pending, metrics).

    `pending_in_host_memory`: where the returned pending gradients of the stacked leaves are made, as
    `pending_shardings` places them (host memory, or HBM with False).

    `objective(params, batch)` -> (what the step differentiates, that batch's metrics) is the step's
    (recipes/train/step.make_objective). The params and opt_state returned have the *pending* update
    applied (the one the returned `pending` does not hold); `flush` applies the rest. Metrics: the
    objective's of this step's batch (its loss, and what its blocks emitted), the norm of its gradients
    and the learning rate they will be applied with, as the step without deferral reports them.
    """
    def train_step(params, opt_state, pending: PendingUpdate, batch):
        begun = optimizer.begin(pending.grads, opt_state, params, apply=pending.apply, grad_norm=pending.grad_norm)
        leaves, treedef = jax.tree.flatten(begun.params)
        pending_leaves = treedef.flatten_up_to(pending.grads)
        in_forward = set(begun.layer_update)
        # What the step differentiates: the pending gradients' buffers for the leaves updated in
        # the forward pass (what comes back for them is the new gradient), the weights for the rest.
        differentiated = treedef.unflatten([pending_leaves[k] if k in in_forward else leaf
                                            for k, leaf in enumerate(leaves)])

        def loss_with_update(differentiated, norm_probe, batch):
            differentiated_leaves = treedef.flatten_up_to(differentiated)
            # On host the hook reads the pending gradients as given and each layer's row is its grad_sink;
            # in HBM the stacked pending gradients (the differentiated ones) ride in the hook's carry, and
            # no row is in the layer state.
            read = pending_leaves if pending_in_host_memory else differentiated_leaves
            hook = _UpdateBeforeEachLayer(begun, {k: read[k] for k in in_forward}, norm_probe,
                                          pending_in_host_memory)
            wrapped = [_UpdatedBeforeUse(leaves[k], d if pending_in_host_memory else None, k) if k in in_forward
                       else d for k, d in enumerate(differentiated_leaves)]
            with layer_hook.running_before_layers(hook):
                value, batch_metrics = objective(treedef.unflatten(wrapped), batch)
            if in_forward and hook.outputs is None:
                raise ValueError("offload.update=next_forward: the model ran no block stack that took the update")
            if hook.final_sinks is not None:
                value = value + _seeded_with_itself(hook.final_sinks)
            return value, (hook.outputs or {}, batch_metrics)

        (_, (stacked, batch_metrics)), (grads, stacked_squares) = jax.value_and_grad(
            loss_with_update, argnums=(0, 1), has_aux=True)(differentiated, jnp.zeros((), jnp.float32), batch)
        new_params, new_opt_state, _ = begun.finish(stacked)
        grad_leaves = treedef.flatten_up_to(grads)
        squares = [stacked_squares] + [streaming.squared_norm(g) for k, g in enumerate(grad_leaves)
                                       if k not in in_forward]
        grad_norm = jnp.sqrt(functools.reduce(operator.add, squares))
        metrics = {**batch_metrics, "grad_norm": grad_norm, "learning_rate": optimizer.schedule(new_opt_state.count)}
        return new_params, new_opt_state, PendingUpdate(grads, grad_norm, jnp.ones((), bool)), metrics

    return train_step


def make_flush(optimizer, pending_in_host_memory: bool = True):
    """(params, opt_state, pending) -> the same with the pending update applied, and nothing pending.

    The stacked leaves are updated by the step's own hook (`_UpdateBeforeEachLayer.before_layer`), in a
    scan of their own over the layers, so that a run which flushes (before a checkpoint) and resumes has
    the weights of the run that went on, bit for bit: the same rows fetched, updated and written back by
    the same code in the same loop. The scan goes through `jax.linearize` (its tangent never used, so
    never compiled) because the step's goes through `value_and_grad`: JAX then computes the body's
    loop-invariant scalars (the bias corrections, the learning rate) before the loop and hands them in,
    and XLA simplifies the update's divisions alike in both programs. docs/DESIGN.md section 6 says what
    each half fixed. `pending_in_host_memory`: where the pending gradients wait, as for the step.
    """
    def flush(params, opt_state, pending: PendingUpdate):
        begun = optimizer.begin(pending.grads, opt_state, params, apply=pending.apply, grad_norm=pending.grad_norm)
        leaves, treedef = jax.tree.flatten(begun.params)
        pending_leaves = treedef.flatten_up_to(pending.grads)
        in_forward = sorted(begun.layer_update)

        def stacked_update(norm_probe):
            hook = _UpdateBeforeEachLayer(begun, {k: pending_leaves[k] for k in in_forward}, norm_probe,
                                          pending_in_host_memory)

            def each_layer(before, carry, layer_index, weights):
                # No gradient sink: nothing here is differentiated for its gradient.
                rows = {k: _UpdatedBeforeUse(weights[k], None, k) for k in in_forward}
                carry, _, new_weights = before(carry, layer_index, rows)
                return carry, new_weights

            # The layers walked as the block stack walks them (a split's resident layers in a scan first).
            carry, parts = layer_hook.scan_hooked_layers(hook, each_layer, hook.start(),
                                                         {k: leaves[k] for k in in_forward},
                                                         hook.resident_layers + hook.num_layers)
            hook.collect(layer_hook.join_layers(parts), carry)
            return hook.outputs

        stacked = jax.linearize(stacked_update, jnp.zeros((), jnp.float32))[0] if in_forward else {}
        params, opt_state, _ = begun.finish(stacked)
        return params, opt_state, PendingUpdate(pending.grads, pending.grad_norm, jnp.zeros((), bool))
    return flush


def nothing_pending(params) -> PendingUpdate:
    """A PendingUpdate with nothing to apply (zero gradients), for the first step; jit it with
    `pending_shardings` so that the stacked leaves' land where the step keeps them (host memory, or HBM)."""
    return PendingUpdate(jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), jnp.zeros((), bool))


def pending_shardings(optimizer, param_shardings, scalar_sharding,
                      pending_in_host_memory: bool = True) -> PendingUpdate:
    """Where a PendingUpdate lives: the gradients of the leaves updated in the forward pass in pinned host
    memory (`pending_in_host_memory`; with False in HBM, like their parameters), the rest like their
    parameters; the scalars replicated."""
    leaves, treedef = jax.tree.flatten(param_shardings)
    in_forward = optimizer.updated_in_forward() if pending_in_host_memory else set()
    grads = treedef.unflatten([host_sharding(s) if k in in_forward else s for k, s in enumerate(leaves)])
    return PendingUpdate(grads, scalar_sharding, scalar_sharding)
