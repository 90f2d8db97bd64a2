"""How a model runs, as opposed to what it is: dtypes, attention kernel, flash block size, init scale.

Every family's config holds only its architecture; these execution settings are
shared by all families and live once, in the recipe (`execution.*`), so no
family copies them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spillway.layers.errors import ConfigError, require_positive

ATTENTION_IMPLS = ("xla", "cudnn", "flash")   # what each one is: layers/attention.py


@dataclasses.dataclass(frozen=True)
class Execution:
    dtype: str = "float32"          # compute dtype of activations and matmuls
    param_dtype: str = "float32"    # dtype the parameters are stored in
    attention_impl: str = "xla"     # "xla" | "cudnn" | "flash" (layers/attention.py)
    flash_block_size: int = 512     # query/key block of the flash kernel
    init_std: float = 0.02          # std of the normal init of matrices and embeddings

    def __post_init__(self):
        for field in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, field))
            except TypeError:
                raise ConfigError(f"execution.{field}: {getattr(self, field)!r} is not a dtype "
                                 f"(e.g. float32, bfloat16)") from None
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"execution.attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        require_positive("execution", flash_block_size=self.flash_block_size, init_std=self.init_std)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self):
        return jnp.dtype(self.param_dtype)
