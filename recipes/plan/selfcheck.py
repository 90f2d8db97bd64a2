"""Check that deviceless GPU compiles work here and that host offload shows up in them.

A compile-process program (run it through ``run_in_compile_process`` or directly:
``python -m spillway.recipes.plan.selfcheck --target h200``) that compiles small programs
for GPU targets and prints one JSON document:

* ``policies``: a scanned stack of MLP blocks, forward + backward + SGD, under
  three treatments of the named hidden activation: saved in HBM, offloaded to
  pinned host memory, recomputed. Offload must show host buffers and host bytes
  and use no more HBM than saving; recomputing must use less.
* ``sharded``: the same step data-parallel over a 2-GPU topology.
* ``host_arguments``: an optimizer-style update whose moments are ``pinned_host``
  arguments, streamed through HBM one layer at a time; and a variant whose only
  arguments are in host memory (which needs the compile mesh set explicitly).
* ``targets``: the offloading step compiled for every known target, each
  reported as ok with its numbers or failed with the error.

The tests use it (tests/recipes/plan/test_aot.py), and it is a quick way to see
whether a machine can plan. Sizes are small so that the whole run takes seconds.
"""

from __future__ import annotations

import argparse
from typing import Any

# Importing JAX does not start its backends; serve_compile_process sets the
# process up for the plugin before anything here creates a device or compiles.
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spillway.recipes.plan import plugin
from spillway.recipes.plan.compile import abstract_array, compile_only_mesh, compile_report, on_compile_mesh
from spillway.recipes.plan.subprocess_runner import serve_compile_process
from spillway.recipes.targets import DEFAULT_GPU, target_names

CHECKS = ("policies", "sharded", "host_arguments", "targets")
HIDDEN_NAME = "mlp_hidden"


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m spillway.recipes.plan.selfcheck",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU, help="GPU target of the main checks")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    args.checks = [check.strip().replace("-", "_") for check in args.checks.split(",")
                   if check.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {CHECKS}")
    return args


def main(argv: list[str]) -> dict[str, Any]:
    args = _parse_args(argv)
    result: dict[str, Any] = {"jax_version": jax.__version__,
                              "plugin_version": plugin.installed_version()}
    if "policies" in args.checks:
        result["policies"] = _check_policies(args)
    if "sharded" in args.checks:
        result["sharded"] = _check_sharded(args)
    if "host_arguments" in args.checks:
        result["host_arguments"] = _check_host_arguments(args)
    if "targets" in args.checks:
        result["targets"] = {name: _check_target(name) for name in target_names()}
    return result


def _policies() -> dict[str, Any]:
    policies = jax.checkpoint_policies
    return {
        "save": policies.save_only_these_names(HIDDEN_NAME),
        "offload": policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[HIDDEN_NAME],
            offload_src="device", offload_dst="pinned_host"),
        "recompute": policies.nothing_saveable,
    }


def make_mlp_train_step(policy: Any, learning_rate: float = 1e-3):
    """SGD step of a scanned stack of residual MLP blocks with a named hidden activation."""

    def block(x_td, weights):
        w_in_df, w_out_fd = weights
        hidden_tf = checkpoint_name(jax.nn.gelu(x_td @ w_in_df), HIDDEN_NAME)
        return x_td + hidden_tf @ w_out_fd

    block = jax.checkpoint(block, policy=policy)

    def loss_fn(params, x_td, y_td):
        out_td, _ = jax.lax.scan(lambda carry, weights: (block(carry, weights), None),
                                 x_td, params)
        return jnp.mean((out_td.astype(jnp.float32) - y_td.astype(jnp.float32)) ** 2)

    def train_step(params, x_td, y_td):
        loss, grads = jax.value_and_grad(loss_fn)(params, x_td, y_td)
        params = jax.tree.map(lambda p, g: (p - learning_rate * g).astype(p.dtype), params, grads)
        return params, loss

    return train_step


def _mlp_arguments(mesh, tokens: int, d_model: int, layers: int, batch_spec):
    """(params, x, y) on ``mesh``: replicated bf16 weights, batch split by ``batch_spec``."""
    params = (abstract_array((layers, d_model, 4 * d_model), jnp.bfloat16, mesh),
              abstract_array((layers, 4 * d_model, d_model), jnp.bfloat16, mesh))
    x_td, y_td = (abstract_array((tokens, d_model), jnp.bfloat16, mesh, batch_spec)
                  for _ in range(2))
    return params, x_td, y_td


def _check_policies(args: argparse.Namespace) -> dict[str, Any]:
    mesh = compile_only_mesh(args.target, {"data": 1})
    arguments = _mlp_arguments(mesh, args.tokens, args.d_model, args.layers, P())
    reports = {}
    for name, policy in _policies().items():
        step = jax.jit(make_mlp_train_step(policy), donate_argnums=0)
        reports[name] = compile_report(step, *arguments).to_dict()
    hidden_bytes = args.tokens * 4 * args.d_model * 2
    return {"target": args.target, "reports": reports,
            "hidden_bytes_per_layer": hidden_bytes, "layers": args.layers}


def _check_sharded(args: argparse.Namespace) -> dict[str, Any]:
    # Shardings as training code builds them (here on an abstract mesh with the
    # same axis names), re-homed onto the compile-only devices.
    batch_sharding = NamedSharding(AbstractMesh((2,), ("data",)), P("data"))
    d_model, layers = args.d_model, args.layers
    arguments = (
        (jax.ShapeDtypeStruct((layers, d_model, 4 * d_model), jnp.bfloat16),
         jax.ShapeDtypeStruct((layers, 4 * d_model, d_model), jnp.bfloat16)),
        jax.ShapeDtypeStruct((args.tokens, d_model), jnp.bfloat16, sharding=batch_sharding),
        jax.ShapeDtypeStruct((args.tokens, d_model), jnp.bfloat16, sharding=batch_sharding),
    )
    mesh = compile_only_mesh(args.target, {"data": 2})
    step = jax.jit(make_mlp_train_step(_policies()["offload"]), donate_argnums=0)
    report = compile_report(step, *on_compile_mesh(arguments, mesh), keep_hlo_text=True)
    return {"report": report.to_dict(),
            "has_all_reduce": "all-reduce" in (report.hlo_text or ""),
            "param_bytes": 2 * layers * d_model * 4 * d_model * 2,
            "batch_bytes_per_array": args.tokens * d_model * 2}


def make_streamed_update(learning_rate: float = 1e-3):
    """Momentum-SGD whose fp32 momentum lives in host memory and visits HBM a layer at a time.

    Transfers inside the function use ``jax.memory.Space``: a NamedSharding over
    the compile-only devices would lose its memory kind (see spillway.recipes.plan.compile).
    """

    def update(params_lxy, grads_lxy, momentum_lxy):
        def one_layer(layer, carry):
            params, momentum = carry
            velocity = jax.device_put(jax.lax.dynamic_index_in_dim(momentum, layer, 0, False),
                                      jax.memory.Space.Device)
            velocity = 0.9 * velocity + grads_lxy[layer].astype(jnp.float32)
            new_param = params[layer].astype(jnp.float32) - learning_rate * velocity
            params = jax.lax.dynamic_update_index_in_dim(
                params, new_param.astype(params.dtype), layer, 0)
            momentum = jax.lax.dynamic_update_index_in_dim(
                momentum, jax.device_put(velocity, jax.memory.Space.Host), layer, 0)
            return params, momentum

        return jax.lax.fori_loop(0, params_lxy.shape[0], one_layer, (params_lxy, momentum_lxy))

    return update


def _check_host_arguments(args: argparse.Namespace) -> dict[str, Any]:
    mesh = compile_only_mesh(args.target, {"data": 1})
    shape = (args.layers, args.d_model, 4 * args.d_model)
    params, grads, momentum = on_compile_mesh(
        (jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct(shape, jnp.bfloat16),
         jax.ShapeDtypeStruct(shape, jnp.float32)),
        mesh, specs=P(), memory_kinds=(None, "device", "pinned_host"))
    update = jax.jit(make_streamed_update(), donate_argnums=(0, 2))
    report = compile_report(update, params, grads, momentum)

    # Only host-memory arguments: no concrete sharding names the devices, so
    # compile_report has to find the compile mesh itself.
    def decay(momentum_lxy):
        momentum_on_device = jax.device_put(momentum_lxy, jax.memory.Space.Device)
        return jax.device_put(0.5 * momentum_on_device, jax.memory.Space.Host)

    host_only = compile_report(jax.jit(decay), momentum)
    elements = args.layers * args.d_model * 4 * args.d_model
    return {"report": report.to_dict(), "host_only_report": host_only.to_dict(),
            "param_bytes": 2 * elements, "grad_bytes": 2 * elements,
            "momentum_bytes": 4 * elements}


def _check_target(name: str) -> dict[str, Any]:
    try:
        mesh = compile_only_mesh(name, {"data": 1})
        arguments = _mlp_arguments(mesh, 512, 256, 2, P())
        step = jax.jit(make_mlp_train_step(_policies()["offload"]), donate_argnums=0)
        return {"ok": True, "report": compile_report(step, *arguments).to_dict()}
    except Exception as error:   # a failing target is reported, not fatal
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}


if __name__ == "__main__":
    serve_compile_process(main)
