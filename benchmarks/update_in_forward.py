#!/usr/bin/env python
"""Can the optimizer update ride under the next step's forward pass? What XLA's schedule does with it.

With the optimizer state in host memory the streamed update runs after the
backward pass with no compute beside it (AdamW with global-norm clipping
needs every gradient first). Deferring layer t's update into the next step's
forward pass, just before layer t is used, keeps the maths and gives the
copies the forward's matmuls to hide behind. This measures, on a small
stand-in compiled deviceless for a GPU target (no model, no recipe), whether
XLA's schedule lets it:

    a scan over L layers; in iteration t: layer t's AdamW state (mu, nu, fp32
    master, in pinned host memory) comes into HBM, the update makes layer t's
    new bf16 weight, the new state goes back to host memory, and the layer
    (two matmuls, rematerialised) runs with the new weight; the gradient
    reaches the old weight unchanged (a straight-through custom VJP), so the
    step returns the new weights, the new state and the next gradients.

Two ways to bring the state in:

    sliced      the state rows are the scan's inputs (xs), as weights are
    prefetched  layer t+1's state is fetched in iteration t and carried into
                the next iteration (double buffering, as the streamed update does)
    in_place    prefetched, with the state itself in the carry (donated): iteration
                t writes layer t-1's new rows over the old ones, then reads layer
                t+1's from the buffers written (recipes/optim/update_in_forward.py)

Per variant: HBM and host bytes of the compiled step (buffer assignment),
link bytes of the forward pass, bytes moved with both link directions in
flight together (recipes/plan/hlo.py overlapping_host_copies), and per loop
iteration of the forward scan how many host copies are in flight across a
matmul (their start before it, their done after it: hidden under compute).

Run:  .venv/bin/python benchmarks/update_in_forward.py [--target h200] [--layers 16] [--d-model 2048]
      [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import prepare_compile_process  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU

MiB = 2**20
VARIANTS = ("sliced", "prefetched", "in_place")


def build_step(variant: str, num_layers: int):
    """The stand-in train step: (weights, pending grads, mu, nu, master, x) -> (new weights, grads, new state, loss)."""
    import jax
    import jax.numpy as jnp

    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    @jax.custom_vjp
    def straight_through(old_weight, new_weight):
        return new_weight

    straight_through.defvjp(lambda old, new: (new, None), lambda _, cotangent: (cotangent, None))

    def layer(x, w):
        return jnp.tanh(x @ w) @ w.T + x

    def adamw(grad, mu, nu, master):
        g = grad.astype(jnp.float32)
        mu = 0.9 * mu + 0.1 * g
        nu = 0.95 * nu + 0.05 * g * g
        master = master - 1e-3 * (mu / (jnp.sqrt(nu) + 1e-8) + 0.1 * master)
        return mu, nu, master

    def step(weights, grads, mu, nu, master, x0):
        def fetch(t):
            return tuple(jax.device_put(jax.lax.dynamic_index_in_dim(a, t, keepdims=False), device)
                         for a in (mu, nu, master))

        def use_layer(x, weight_row, grad_row, state_rows):
            new_mu, new_nu, new_master = adamw(grad_row, *state_rows)
            new_weight = jax.lax.stop_gradient(new_master.astype(weight_row.dtype))
            used = straight_through(weight_row, new_weight)
            x = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(x, used)
            return x, (new_weight, *(jax.device_put(a, host) for a in (new_mu, new_nu, new_master)))

        def in_place_scan(weights):
            def body(carry, rows):
                x, state, current, previous = carry
                weight_row, grad_row, t = rows
                state = tuple(jax.lax.dynamic_update_index_in_dim(s, jax.device_put(p, host), jnp.maximum(t - 1, 0), 0)
                              for s, p in zip(state, previous))
                upcoming = tuple(jax.device_put(jax.lax.dynamic_index_in_dim(a, jnp.minimum(t + 1, num_layers - 1),
                                                                             keepdims=False), device) for a in state)
                new_rows = adamw(grad_row, *current)
                new_weight = jax.lax.stop_gradient(new_rows[2].astype(weight_row.dtype))
                used = straight_through(weight_row, new_weight)
                x = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(x, used)
                return (x, state, upcoming, new_rows), new_weight
            first = fetch(0)
            (x, state, _, last), new_weights = jax.lax.scan(body, (x0, (mu, nu, master), first, first),
                                                            (weights, grads, jnp.arange(num_layers)))
            state = tuple(jax.lax.dynamic_update_index_in_dim(s, jax.device_put(p, host), num_layers - 1, 0)
                          for s, p in zip(state, last))
            return x, (new_weights, *state)

        def loss(weights):
            if variant == "in_place":
                x, outs = in_place_scan(weights)
                return jnp.sum(x.astype(jnp.float32)), outs
            if variant == "sliced":
                def body(x, rows):
                    weight_row, grad_row, *state_rows = rows
                    state_rows = tuple(jax.device_put(a, device) for a in state_rows)
                    return use_layer(x, weight_row, grad_row, state_rows)
                x, outs = jax.lax.scan(body, x0, (weights, grads, mu, nu, master))
            else:
                def body(carry, rows):
                    x, current = carry
                    weight_row, grad_row, t = rows
                    upcoming = fetch(jnp.minimum(t + 1, num_layers - 1))   # issued before layer t's work
                    x, out = use_layer(x, weight_row, grad_row, current)
                    return (x, upcoming), out
                (x, _), outs = jax.lax.scan(body, (x0, fetch(0)), (weights, grads, jnp.arange(num_layers)))
            return jnp.sum(x.astype(jnp.float32)), outs

        (value, (new_weights, *new_state)), new_grads = jax.value_and_grad(loss, has_aux=True)(weights)
        return new_weights, new_grads, *new_state, value

    # Weights and gradients are donated (the grads' buffer becomes the next
    # gradients'); the state is not: donated, XLA copies the scan's host
    # output into the donated buffer after the loop, over the link again.
    # In place, the carried state is donated too.
    return jax.jit(step, donate_argnums=(0, 1, 2, 3, 4) if variant == "in_place" else (0, 1))


def copies_across_matmuls(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Per direction ("in": host->device, "out"), (async host copies of the forward scan's body in flight
    across a matmul, its async host copies).

    The forward body is the loop computation with the most host transfers
    (hlo.host_transfers); a copy spans a matmul when its *-start comes before
    a gemm and its *-done after it in the scheduled order.
    """
    import collections

    from spillway.recipes.plan import hlo

    transfers, _ = hlo.host_transfers(hlo_text)
    per_computation = collections.Counter(t.computation for t in transfers if t.opcode.endswith("-start"))
    if not per_computation:
        return {"in": (0, 0), "out": (0, 0)}
    body = per_computation.most_common(1)[0][0]
    direction = {t.instruction: "in" if t.host_to_device_bytes else "out"
                 for t in transfers if t.computation == body and t.opcode.endswith("-start")}
    instructions = hlo.parse_computations(hlo_text)[0][body]
    matmuls = [k for k, i in enumerate(instructions) if "gemm" in i.name or "cublas" in i.attributes]
    started = {i.name: k for k, i in enumerate(instructions) if i.name in direction}
    counts = {"in": [0, 0], "out": [0, 0]}
    for k, instruction in enumerate(instructions):
        if instruction.opcode.endswith("-done") and instruction.operands and instruction.operands[0] in started:
            start = instruction.operands[0]
            counts[direction[start]][1] += 1
            counts[direction[start]][0] += any(started[start] < m < k for m in matmuls)
    return {key: tuple(value) for key, value in counts.items()}


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo

    mesh = aot.compile_only_mesh(args.target, {"data": 1})
    shape = (args.layers, args.d_model, args.d_model)
    arguments = (aot.abstract_array(shape, jnp.bfloat16, mesh), aot.abstract_array(shape, jnp.bfloat16, mesh),
                 *(aot.abstract_array(shape, jnp.float32, mesh, memory_kind="pinned_host") for _ in range(3)),
                 aot.abstract_array((args.tokens, args.d_model), jnp.bfloat16, mesh))
    rows = {}
    for variant in VARIANTS:
        report = aot.compile_report(build_step(variant, args.layers), *arguments, keep_hlo_text=True)
        overlap = hlo.overlapping_host_copies(report.hlo_text)
        spanning = copies_across_matmuls(report.hlo_text)
        rows[variant] = {"hbm": report.hbm_bytes, "host": report.host_bytes, "host_temp": report.host_temp_bytes,
                         "forward": hlo.traffic_by_pass(report.hlo_text)["forward"],
                         "overlapped_forward": overlap.overlapped_by_pass["forward"],
                         "copies_across_matmuls": spanning}
    state_bytes = 3 * args.layers * args.d_model ** 2 * 4
    return {"rows": rows, "state_bytes": state_bytes, "jax": jax.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    prepare_compile_process()
    result = measure(args)
    print(f"{args.layers} layers of {args.d_model}x{args.d_model}, {args.tokens} tokens, {args.target}, "
          f"jax {result['jax']}; AdamW state {result['state_bytes'] / MiB:.0f} MiB in host memory")
    print(f"{'variant':12s} {'HBM MiB':>9s} {'host MiB':>9s} {'host temp':>9s} {'fwd H->D':>9s} {'fwd D->H':>9s} "
          f"{'both dirs':>9s}  copies in flight across a matmul, per iteration (in; out)")
    for variant, row in result["rows"].items():
        forward = row["forward"]
        print(f"{variant:12s} {row['hbm'] / MiB:9.1f} {row['host'] / MiB:9.1f} {row['host_temp'] / MiB:9.1f} "
              f"{forward['host_to_device_bytes'] / MiB:9.1f} {forward['device_to_host_bytes'] / MiB:9.1f} "
              f"{row['overlapped_forward'] / MiB:9.1f}  "
              + "; ".join(f"{spanning} of {total}" for spanning, total in row["copies_across_matmuls"].values()))


if __name__ == "__main__":
    main()
