"""The chunked loss equals the whole-sequence loss, value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers.execution import Execution
from spillway.layers.sharding import create_sharded
from spillway.models.llama import Llama, llama_config
from spillway.recipes.train.step import make_loss_fn


def test_chunked_loss_matches_whole_sequence():
    cfg = llama_config("tiny_odd")
    graphdef, params = nnx.split(create_sharded(lambda: Llama(cfg, rngs=nnx.Rngs(0), remat="recompute_all")))
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


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_head_gradient_is_accumulated_in_float32(tie):
    """bf16 weights, 16 chunks: the head's gradient must match the whole-sequence one to bf16 rounding.

    The whole-sequence head gradient is one matmul (fp32 accumulation, one
    rounding to bf16). Summing 16 per-chunk gradients in bf16 would round 16
    times; summed in fp32 and rounded once, chunked and whole differ by at most
    about one bf16 step.
    """
    cfg = llama_config("tiny_odd", tie_embeddings=tie)
    bf16 = Execution(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params = nnx.split(create_sharded(lambda: Llama(cfg, bf16, rngs=nnx.Rngs(0), remat="recompute_all")))
    tokens = jax.random.randint(jax.random.key(0), (2, 65), 0, cfg.vocab_size)
    whole = jax.jit(jax.grad(make_loss_fn(graphdef)))(params, tokens)
    chunked = jax.jit(jax.grad(make_loss_fn(graphdef, loss_chunk=4)))(params, tokens)
    head = (lambda g: g["embed"]["table"]) if tie else (lambda g: g["head"]["w"])
    whole_head = np.asarray(head(whole).get_value(), np.float32)
    chunk_head = np.asarray(head(chunked).get_value(), np.float32)
    scale = np.abs(whole_head).max()
    assert np.abs(chunk_head - whole_head).max() <= 2 ** -7 * scale, np.abs(chunk_head - whole_head).max() / scale
