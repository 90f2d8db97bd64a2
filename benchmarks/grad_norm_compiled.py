"""What the clipping norm's per-layer sums cost in the compiled program, for an H200 without one.

    .venv/bin/python -m benchmarks.grad_norm_compiled

The optimizer sums a stacked leaf's squares layer by layer and adds the layers' sums behind a barrier
(recipes/optim/optimizer.leaf_squared_norm), so that a split weight's two parts give the whole leaf's norm
bit for bit. This compiles that norm, and the one it replaced (each leaf's squares summed whole), over
Llama 3 8B's float32 gradients on one H200 (deviceless), and prints per variant the reduction kernels, the
ones that read a gradient (each must read it once) and the temporary HBM.
"""

from __future__ import annotations

import functools
import operator
import re

from spillway.recipes.plan.subprocess_runner import prepare_compile_process

# Llama 3 8B's leaves: (shape, stacked).
LEAVES = {"embed": ((128256, 4096), False), "head": ((4096, 128256), False), "final_norm": ((4096,), False),
          "wq": ((32, 4096, 4096), True), "wk": ((32, 4096, 1024), True), "wv": ((32, 4096, 1024), True),
          "wo": ((32, 4096, 4096), True), "w_gate": ((32, 4096, 14336), True),
          "w_up": ((32, 4096, 14336), True), "w_down": ((32, 14336, 4096), True),
          "attn_norm": ((32, 4096), True), "mlp_norm": ((32, 4096), True)}


def main() -> None:
    prepare_compile_process()
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from spillway.recipes.optim import host_streaming as streaming
    from spillway.recipes.optim.optimizer import leaf_squared_norm
    from spillway.recipes.plan.compile import gpu_topology

    sharding = SingleDeviceSharding(gpu_topology("h200", 1).devices[0])
    grads = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) for name, (shape, _) in LEAVES.items()}

    def whole_leaf_sums(g):
        return jnp.sqrt(functools.reduce(operator.add, [streaming.squared_norm(g[k]) for k in LEAVES], 0))

    def per_layer_sums(g):
        return jnp.sqrt(functools.reduce(operator.add, [leaf_squared_norm(g[k], stacked)
                                                        for k, (_, stacked) in LEAVES.items()], 0))

    for name, norm in (("whole-leaf sums (before)", whole_leaf_sums), ("per-layer sums + barrier (now)", per_layer_sums)):
        compiled = jax.jit(norm).lower(grads).compile()
        entry = compiled.as_text().split("\nENTRY", 1)[1]
        fusions = re.findall(r"= (\S+) fusion\(([^)]*)\)", entry)
        readers = [operands for _, operands in fusions if re.search(r"%g__\w+__", operands)]
        read_twice = len(readers) - len({re.search(r"%g__(\w+?)__", r).group(1) for r in readers})
        print(f"{name}: {len(fusions)} fusions, {len(readers)} read a gradient ({read_twice} read one twice), "
              f"temp {compiled.memory_analysis().temp_size_in_bytes / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
