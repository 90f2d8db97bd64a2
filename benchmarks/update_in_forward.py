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
    parity      in place, the state of even and odd layers in two buffers each
                (donated): the carry holds (this layer's parity's buffers, the
                other's) and swaps them every layer, the scan unrolled by two so
                that each buffer comes back to its own place in the loop's carry;
                layer t's new rows go into its buffer while layer t+1's are read
                from the other, so neither copy waits on the other
    parity_counted  parity, a pair of layers per scan step and every row offset the
                pair counter carried through the scan (k, k + 1; the last pair
                after the scan), so that XLA moves the rows with memcpys, not
                kernels (docs/DESIGN.md section 6)

and `*_tied`: the same with layer t's update (and its copies' sources) tied to
the layer's input by an optimization_barrier, so that it runs after layer t-1's
matmuls instead of being hoisted above them.

Compiled with the train step's XLA settings (recipes/train/xla_settings.py);
--async-compute-limit 2 compiles with XLA's default limit of async host
copies in flight, which is what the step had before that setting.

Per variant: HBM and host bytes of the compiled step (buffer assignment; host
temp and alias), link bytes of the forward pass, bytes moved with both link
directions in flight together (recipes/plan/hlo.py overlapping_host_copies),
the forward pass's copy bytes whose window holds a matmul (what the planner
reads: hlo.host_copies_beside_compute), the bytes moved by kernels rather than
memcpys (hlo.host_copy_engines: a row index that is not the loop's counter), and per loop body of the forward scan
how many host copies are in flight across a matmul (their start before it,
their done after it).

and `in_hbm`: the `sliced` step with the state in HBM (nothing over the link), the baseline of --time.

--time runs on a GPU instead (the machine's own): the step of each variant (default: in_hbm, in_place_tied,
parity_tied, parity_counted_tied) with real arrays, under the step's XLA settings, with command buffers
scheduled by their data dependencies alone, and with the dynamic-slice memcpys kept out of them; median ms
per step (what each program shape and setting hides of the link, against in_hbm).

Run:  .venv/bin/python benchmarks/update_in_forward.py [--target h200] [--layers 16] [--d-model 2048]
      [--tokens 4096] [--variants in_place,parity_tied] [--async-compute-limit 2]
      python benchmarks/update_in_forward.py --time [--layers 16] [--d-model 4096] [--tokens 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import served_or_measured  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU

MiB = 2**20
VARIANTS = ("sliced", "prefetched", "in_place", "in_place_tied", "parity", "parity_tied", "parity_counted",
            "parity_counted_tied")
# Timed on a GPU (--time): the state in HBM (the baseline), the step's shape today, and the two parity shapes.
TIMED_VARIANTS = ("in_hbm", "in_place_tied", "parity_tied", "parity_counted_tied")
# XLA's command-buffer settings each timed variant runs under, on top of the step's (docs/DESIGN.md section 6;
# recipes/train/xla_settings.py COMMAND_BUFFER_ALTERNATIVES, less "off": three settings keep the GPU call short).
TIMED_SETTINGS = ("step settings", "command buffers concurrent", "memcpys outside command buffers")


def build_step(variant: str, num_layers: int, compiler_options: dict | None = None):
    """The stand-in train step: (weights, pending grads, mu, nu, master, x) -> (new weights, grads, new state, loss).

    For `parity*` each of mu, nu, master is a pair (even layers, odd layers)."""
    import jax
    import jax.numpy as jnp

    tied = variant.endswith("_tied")
    variant = variant.removesuffix("_tied")

    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    if variant == "in_hbm":   # the baseline: `sliced` with the state in HBM, nothing over the link
        host, variant = device, "sliced"

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
                if tied:   # layer t's update and copies after layer t-1's compute
                    x, current, previous = jax.lax.optimization_barrier((x, current, previous))
                    current, previous = jax.lax.stop_gradient((current, previous))
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

        def parity_scan(weights):
            # Even layers' state in one buffer, odd layers' in another; the carry holds (this layer's
            # parity's buffers, the other's) and swaps them every layer, unrolled by two so the loop body
            # hands every buffer back at its own place. Layer t's new rows go into its buffer while layer
            # t+1's are read from the other: two buffers, so neither copy waits on the other.
            def body(carry, rows):
                x, here, there, current = carry
                weight_row, grad_row, t = rows
                if tied:   # layer t's update after layer t-1's compute (stop_gradient: the state has no tangent)
                    x, current = jax.lax.optimization_barrier((x, current))
                    current = jax.lax.stop_gradient(current)
                new_rows = adamw(grad_row, *current)
                here = tuple(jax.lax.dynamic_update_index_in_dim(s, jax.device_put(p, host), t // 2, 0)
                             for s, p in zip(here, new_rows))
                upcoming = tuple(jax.device_put(jax.lax.dynamic_index_in_dim(
                    s, jnp.minimum((t + 1) // 2, s.shape[0] - 1), keepdims=False), device) for s in there)
                new_weight = jax.lax.stop_gradient(new_rows[2].astype(weight_row.dtype))
                used = straight_through(weight_row, new_weight)
                x = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(x, used)
                return (x, there, here, upcoming), new_weight
            even, odd = (mu[0], nu[0], master[0]), (mu[1], nu[1], master[1])
            first = tuple(jax.device_put(jax.lax.dynamic_index_in_dim(s, 0, keepdims=False), device) for s in even)
            (x, even, odd, _), new_weights = jax.lax.scan(body, (x0, even, odd, first),
                                                          (weights, grads, jnp.arange(num_layers)), unroll=2)
            return x, (new_weights, *zip(even, odd))

        def parity_counted_scan(weights):
            # Parity, with every row's offset the loop's own counter (a pair index k carried from 0 by 1) so
            # that XLA moves the rows with memcpys (hlo.host_copy_engines): the scan takes a pair of layers a
            # step, layer 2k's rows into even[k] while layer 2k+1's are read from odd[k], layer 2k+1's into
            # odd[k] while layer 2k+2's are read from even[k+1]; the last pair runs after the scan, so that no
            # offset in the loop is ever clamped.
            pairs = num_layers // 2

            def layer_step(x, weight_row, grad_row, current, own, k, fetch_from, fetch_at):
                if tied:
                    x, current = jax.lax.optimization_barrier((x, current))
                    current = jax.lax.stop_gradient(current)
                new_rows = adamw(grad_row, *current)
                own = tuple(jax.lax.dynamic_update_index_in_dim(s, jax.device_put(p, host), k, 0)
                            for s, p in zip(own, new_rows))
                upcoming = None if fetch_from is None else tuple(
                    jax.device_put(jax.lax.dynamic_index_in_dim(s, fetch_at, keepdims=False), device)
                    for s in fetch_from)
                new_weight = jax.lax.stop_gradient(new_rows[2].astype(weight_row.dtype))
                used = straight_through(weight_row, new_weight)
                x = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(x, used)
                return x, own, upcoming, new_weight

            def body(carry, rows):
                x, even, odd, current, k = carry
                weight_pair, grad_pair = rows
                x, even, current, first = layer_step(x, weight_pair[0], grad_pair[0], current, even, k, odd, k)
                x, odd, current, second = layer_step(x, weight_pair[1], grad_pair[1], current, odd, k, even, k + 1)
                return (x, even, odd, current, k + 1), jnp.stack([first, second])

            even, odd = (mu[0], nu[0], master[0]), (mu[1], nu[1], master[1])
            first = tuple(jax.device_put(jax.lax.dynamic_index_in_dim(s, 0, keepdims=False), device) for s in even)
            as_pairs = lambda a: a.reshape(pairs, 2, *a.shape[1:])   # noqa: E731
            weight_pairs, grad_pairs = as_pairs(weights), as_pairs(grads)
            (x, even, odd, current, _), new_weights = jax.lax.scan(
                body, (x0, even, odd, first, jnp.int32(0)), (weight_pairs[:-1], grad_pairs[:-1]))
            last = pairs - 1
            x, even, current, w_even = layer_step(x, weight_pairs[-1, 0], grad_pairs[-1, 0], current, even, last,
                                                  odd, last)
            x, odd, _, w_odd = layer_step(x, weight_pairs[-1, 1], grad_pairs[-1, 1], current, odd, last, None, None)
            new_weights = jnp.concatenate([new_weights.reshape(-1, *weights.shape[1:]),
                                           jnp.stack([w_even, w_odd])])
            return x, (new_weights, *zip(even, odd))

        def loss(weights):
            if variant == "parity_counted":
                x, outs = parity_counted_scan(weights)
                return jnp.sum(x.astype(jnp.float32)), outs
            if variant == "parity":
                x, outs = parity_scan(weights)
                return jnp.sum(x.astype(jnp.float32)), outs
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
    return jax.jit(step, donate_argnums=(0, 1, 2, 3, 4) if variant in ("in_place", "parity", "parity_counted") else (0, 1),
                   compiler_options=compiler_options)


def copies_across_matmuls(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Per direction ("in": host->device, "out"), (async host copies of the forward scan's body in flight
    across a matmul, its async host copies).

    The forward body is the loop computation (not the entry) with the most
    host transfers (hlo.host_transfers); a copy spans a matmul when its
    *-start comes before a gemm and its *-done after it in the scheduled
    order. An unrolled body holds two layers.
    """
    import collections

    from spillway.recipes.plan import hlo

    transfers, _ = hlo.host_transfers(hlo_text)
    _, entry = hlo.parse_computations(hlo_text)
    per_computation = collections.Counter(t.computation for t in transfers
                                          if t.opcode.endswith("-start") and t.computation != entry)
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
    from spillway.recipes.train import xla_settings

    options = xla_settings.step_compiler_options("cuda")
    if args.async_compute_limit is not None:
        options["xla_gpu_experimental_parallel_async_compute_limit"] = args.async_compute_limit
    mesh = aot.compile_only_mesh(args.target, {"data": 1})
    shape = (args.layers, args.d_model, args.d_model)
    half = (args.layers // 2, args.d_model, args.d_model)

    def state_array(variant):
        if variant == "in_hbm":
            return aot.abstract_array(shape, jnp.float32, mesh)
        if variant.startswith("parity"):   # (even layers, odd layers)
            return tuple(aot.abstract_array(half, jnp.float32, mesh, memory_kind="pinned_host") for _ in range(2))
        return aot.abstract_array(shape, jnp.float32, mesh, memory_kind="pinned_host")

    rows = {}
    for variant in args.variants.split(","):
        arguments = (aot.abstract_array(shape, jnp.bfloat16, mesh), aot.abstract_array(shape, jnp.bfloat16, mesh),
                     *(state_array(variant) for _ in range(3)),
                     aot.abstract_array((args.tokens, args.d_model), jnp.bfloat16, mesh))
        report = aot.compile_report(build_step(variant, args.layers, options), *arguments, keep_hlo_text=True)
        overlap = hlo.overlapping_host_copies(report.hlo_text)
        beside = hlo.host_copies_beside_compute(report.hlo_text)
        rows[variant] = {"hbm": report.hbm_bytes, "host": report.host_bytes, "host_temp": report.host_temp_bytes,
                         "host_alias": report.host_alias_bytes,
                         "forward": hlo.traffic_by_pass(report.hlo_text)["forward"],
                         "overlapped_forward": overlap.overlapped_by_pass["forward"],
                         "beside_matmul_forward": (beside.beside_compute_by_pass["forward"],
                                                   beside.moved_by_pass["forward"]),
                         "copies_across_matmuls": copies_across_matmuls(report.hlo_text),
                         "kernel_bytes": report.host_kernel_copy_bytes}
    state_bytes = 3 * args.layers * args.d_model ** 2 * 4
    return {"rows": rows, "state_bytes": state_bytes, "jax": jax.__version__, "options": options}


def time_variants(args) -> dict:
    """On this machine's GPU: each of --variants (default TIMED_VARIANTS) under each COMMAND_BUFFER_SETTINGS,
    median ms of --repeats steps after one warm-up; each call takes the previous call's outputs (the donated
    state written in place)."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from spillway.recipes.train import xla_settings

    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    shape = (args.layers, args.d_model, args.d_model)
    half = (args.layers // 2, args.d_model, args.d_model)

    def state_array(variant):
        if variant == "in_hbm":
            return jax.device_put(jnp.full(shape, 0.01, jnp.float32), device)
        if variant.startswith("parity"):
            return tuple(jax.device_put(np.full(half, 0.01, np.float32), pinned) for _ in range(2))
        return jax.device_put(np.full(shape, 0.01, np.float32), pinned)

    settings = {name: xla_settings.COMMAND_BUFFER_ALTERNATIVES.get(name, {}) for name in TIMED_SETTINGS}
    rows = {}
    for variant in args.variants.split(","):
        rows[variant] = {}
        # One set of arrays per variant, each call's outputs the next call's inputs (under every setting).
        arguments = [jax.device_put(jnp.full(shape, 0.01, jnp.bfloat16), device),
                     jax.device_put(jnp.full(shape, 0.001, jnp.bfloat16), device),
                     *(state_array(variant) for _ in range(3)),
                     jax.device_put(jnp.full((args.tokens, args.d_model), 0.1, jnp.bfloat16), device)]
        for setting, extra in settings.items():
            options = {**(xla_settings.step_compiler_options(device.platform) or {}), **extra}
            step = build_step(variant, args.layers, options)
            times = []
            for call in range(args.repeats + 1):
                started = time.perf_counter()
                new_weights, new_grads, *new_state, loss = step(*arguments)
                jax.block_until_ready(loss)
                jax.block_until_ready(new_state)
                if call:
                    times.append(time.perf_counter() - started)
                arguments = [new_weights, new_grads, *new_state, arguments[-1]]
            rows[variant][setting] = statistics.median(times)
            if args.progress:   # as measured: a run cut by a timeout keeps what it had
                print(f"  {variant} / {setting}: {rows[variant][setting] * 1e3:.1f} ms", flush=True)
    return {"rows": rows, "jax": jax.__version__, "device": device.device_kind,
            "state_bytes": 3 * args.layers * args.d_model ** 2 * 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--async-compute-limit", type=int, default=None,
                        help="xla_gpu_experimental_parallel_async_compute_limit instead of the step's "
                             "(recipes/train/xla_settings.py); XLA's default is 2")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (a compile process)")
    parser.add_argument("--time", action="store_true",
                        help="on a GPU: time --variants (default: the state in HBM, in_place_tied and the parity "
                             "shapes) under each command-buffer setting, instead of compiling deviceless")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row with --time (default 3)")
    args = parser.parse_args(argv)
    args.progress = False
    if args.time and args.variants == ",".join(VARIANTS):
        args.variants = ",".join(TIMED_VARIANTS)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.layers % 2:
        parser.error("--layers must be even (the parity variants split the layers into even and odd)")
    return args


def main() -> None:
    args = parse_args()
    if args.time:
        args.progress = True
        result = time_variants(args)
        print(f"{args.layers} layers of {args.d_model}x{args.d_model}, {args.tokens} tokens, {result['device']}, "
              f"jax {result['jax']}; AdamW state {result['state_bytes'] / MiB:.0f} MiB; median ms of "
              f"{args.repeats} steps")
        settings = list(TIMED_SETTINGS)
        print(f"{'variant':20s} " + " ".join(f"{name:>26s}" for name in settings))
        for variant, times in result["rows"].items():
            print(f"{variant:20s} " + " ".join(f"{times[name] * 1e3:26.1f}" for name in settings))
        return
    result = served_or_measured(args, parse_args, measure)
    limit = result["options"]["xla_gpu_experimental_parallel_async_compute_limit"]
    print(f"{args.layers} layers of {args.d_model}x{args.d_model}, {args.tokens} tokens, {args.target}, "
          f"jax {result['jax']}, async compute limit {limit}; AdamW state {result['state_bytes'] / MiB:.0f} MiB "
          f"in host memory")
    print(f"{'variant':14s} {'HBM MiB':>8s} {'host MiB':>8s} {'temp':>6s} {'alias':>6s} {'fwd H->D':>8s} "
          f"{'fwd D->H':>8s} {'both':>6s} {'beside matmul':>14s} {'by kernels':>10s}  copies across a matmul per loop "
          f"body (in; out)")
    for variant, row in result["rows"].items():
        forward = row["forward"]
        beside, moved = row["beside_matmul_forward"]
        print(f"{variant:14s} {row['hbm'] / MiB:8.1f} {row['host'] / MiB:8.1f} {row['host_temp'] / MiB:6.0f} "
              f"{row['host_alias'] / MiB:6.0f} {forward['host_to_device_bytes'] / MiB:8.1f} "
              f"{forward['device_to_host_bytes'] / MiB:8.1f} {row['overlapped_forward'] / MiB:6.0f} "
              f"{beside / MiB:6.0f} of {moved / MiB:5.0f} {row['kernel_bytes'] / MiB:10.0f}  "
              + "; ".join(f"{spanning} of {total}" for spanning, total in row["copies_across_matmuls"].values()))


if __name__ == "__main__":
    main()
