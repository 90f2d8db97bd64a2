"""The chunked loss equals the whole-sequence loss, value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.sharding import create_sharded
from models.llama import Llama, llama_config
from recipes.train import make_loss_fn


def test_chunked_loss_matches_whole_sequence():
    cfg = llama_config("tiny_odd", remat="recompute_all")
    graphdef, params = nnx.split(create_sharded(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.random.randint(jax.random.key(0), (2, 25), 0, cfg.vocab_size)
    whole_loss, whole_grads = jax.jit(jax.value_and_grad(make_loss_fn(graphdef)))(params, tokens)
    chunk_loss, chunk_grads = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, loss_chunk=8)))(params, tokens)
    np.testing.assert_allclose(chunk_loss, whole_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), chunk_grads, whole_grads)


def test_chunk_must_divide_the_sequence():
    cfg = llama_config("tiny_odd")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((2, 25), jnp.int32)
    with pytest.raises(ValueError, match=r"loss_chunk \(7\) must divide the sequence length \(24\)"):
        jax.eval_shape(make_loss_fn(graphdef, loss_chunk=7), params, tokens)
