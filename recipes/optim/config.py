"""`OptimizerConfig`: AdamW's hyperparameters, what a recipe sets in its `optimizer` section.

Imports nothing but the error helpers, so `recipes/config.py` takes it without the optimizer's JAX code.
"""

from __future__ import annotations

import dataclasses

from spillway.layers.errors import ConfigError, require_non_negative, require_positive_finite

# What optimizer.moment_dtype may name. float16 is left out: the second moment (squared gradients) underflows
# its range; 8-bit moments would need a per-block scale (docs/DESIGN.md section 6).
MOMENT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's hyperparameters: what a recipe sets in its `optimizer` section.

    Two things the optimizer needs are not here, because the run already has
    one field for each: how long the schedule runs (`total_steps`, from the
    recipe's train.steps) and where the state lives by default
    (`state_memory`, from offload.optimizer_state). They are arguments of
    `Optimizer` and `make_layouts`, so no setting can be written twice and
    silently overwritten.
    """

    learning_rate: float = 3e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    master_weights: bool = True    # fp32 master copy in the state for low-precision params
    # Host leaves updated by the host CPU (layers/jax_compat.on_host) instead of
    # streamed through HBM: no state in HBM at all, but host-speed maths and a
    # host temp the size of the state (benchmarks/optimizer_state_toy.py).
    update_on_host: bool = False
    # The dtype the AdamW moments (mu, nu) are stored in: "float32", or "bfloat16" to halve their bytes
    # (host memory, link time, HBM). The update reads them into float32 and stores its result rounded
    # (optax's mu_dtype, applied to nu too); master weights stay float32. BENCHMARKS.md measures what it
    # costs in validation loss.
    moment_dtype: str = "float32"

    def __post_init__(self):
        # finite: a learning rate of inf trained to a NaN loss, an eps of inf to no update at all
        require_positive_finite("optimizer", learning_rate=self.learning_rate, clip_norm=self.clip_norm)
        # eps > 0: a parameter whose gradient is always zero (an unused embedding row) has
        # mu = nu = 0, and 0 / (sqrt(0) + 0) is NaN.
        require_positive_finite("optimizer", eps=self.eps)
        require_non_negative("optimizer", warmup_steps=self.warmup_steps, weight_decay=self.weight_decay)
        if self.weight_decay == float("inf"):
            raise ConfigError(f"optimizer.weight_decay must be finite, got {self.weight_decay!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.moment_dtype not in MOMENT_DTYPES:
            raise ConfigError(f"optimizer.moment_dtype must be one of {MOMENT_DTYPES} (the dtypes the AdamW "
                              f"update reads and writes), got {self.moment_dtype!r}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
