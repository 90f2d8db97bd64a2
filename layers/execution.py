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
# The float dtypes a model computes in and stores its weights in. float64 is left out: JAX computes in 32 bits
# at most unless jax_enable_x64 is set (it would truncate to float32 with a warning, the recipe saying float64);
# integer dtypes cannot be trained.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Execution:
    dtype: str = "float32"          # compute dtype of activations and matmuls
    param_dtype: str = "float32"    # dtype the parameters are stored in
    attention_impl: str = "xla"     # "xla" | "cudnn" | "flash" (layers/attention.py)
    flash_block_size: int = 512     # query/key block of the flash kernel
    init_std: float = 0.02          # std of the normal init of matrices and embeddings

    def __post_init__(self):
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            try:
                name = jnp.dtype(value).name
            except TypeError:
                name = None
            if name not in FLOAT_DTYPES:
                what = "is not a dtype" if name is None else "is not a dtype a model trains in"
                raise ConfigError(f"execution.{field}: {value!r} {what} (one of {', '.join(FLOAT_DTYPES)})")
            # by its name: an alias ("f4", "single") priced and recorded as what it is
            object.__setattr__(self, field, name)
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
