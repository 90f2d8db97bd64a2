"""The chunked loss equals the whole-sequence loss, value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers.execution import Execution
from spillway.layers.sharding import create_sharded
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config
from spillway.recipes.train.loss import chunked_cross_entropy
from spillway.recipes.train.step import make_loss_fn
from spillway.recipes.train.batch import Batch


def test_chunked_loss_matches_whole_sequence():
    cfg = preset_config("llama", "tiny_odd")
    graphdef, params = nnx.split(create_sharded(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0), remat="recompute_all")))
    tokens = Batch(tokens=jax.random.randint(jax.random.key(0), (2, 25), 0, cfg.vocab_size))
    whole_loss, whole_grads = jax.jit(jax.value_and_grad(make_loss_fn(graphdef)))(params, tokens)
    chunk_loss, chunk_grads = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, loss_chunk=8)))(params, tokens)
    np.testing.assert_allclose(chunk_loss, whole_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), chunk_grads, whole_grads)


def test_chunk_must_divide_the_sequence():
    cfg = preset_config("llama", "tiny_odd")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))
    tokens = Batch(tokens=jax.ShapeDtypeStruct((2, 25), jnp.int32))
    with pytest.raises(ValueError, match=r"loss_chunk \(7\) must divide the sequence length \(24\)"):
        jax.eval_shape(make_loss_fn(graphdef, loss_chunk=7), params, tokens)


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_head_gradient_is_accumulated_in_float32(tie):
    """bf16 head, 64 chunks: the head's gradient must match the exact one to bf16 rounding.

    Each chunk's head gradient comes out of the matmul in bf16. Summed in
    float32 and rounded once, the result stays within a bf16 step or two of
    the exact gradient (measured: 0.26-0.45% of its largest entry on jax
    0.10.2, 0.11.2 and 0.12.0.1; the bound is 0.78%); summed in bf16, it
    rounds once per chunk (1.8-2.5%: a bf16 running sum fails the bound).

    The reference is the exact gradient, in float64, of the same bf16 hidden
    states and head weights; not the whole-sequence gradient that XLA
    computes. On jaxlib 0.12's CPU backend that one is itself 5-7% off: its
    backward bf16 matmul is no longer computed in float32 as on 0.10 (whose
    HLO upcasts both operands), so it accumulates 128 cancelling terms in
    low precision. A GPU accumulates bf16 matmuls in float32 either way.
    """
    cfg = preset_config("llama", "tiny_odd", tie_embeddings=tie)
    bf16 = Execution(dtype="bfloat16", param_dtype="bfloat16")
    model = create_sharded(lambda: DecoderLM(cfg, bf16, rngs=nnx.Rngs(0), remat="recompute_all"))
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 129), 0, cfg.vocab_size))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
    x_btd, _ = nnx.jit(lambda m, t, p: m.hidden_states(t, p))(model, inputs, positions)
    logits_fn, head_params = model.split_head()

    grad = jax.jit(jax.grad(lambda h: chunked_cross_entropy(logits_fn, h, x_btd, targets, 2)))(head_params)
    (chunked,) = jax.tree.leaves(grad)
    (weight,) = jax.tree.leaves(head_params)

    # Exact: d mean(CE) / dW = x^T (softmax(x W) - onehot(targets)) / tokens, in float64.
    w_dv = np.asarray(weight, np.float64).T if tie else np.asarray(weight, np.float64)   # tied: table [v, d]
    x_nd = np.asarray(x_btd, np.float64).reshape(-1, w_dv.shape[0])
    logits = x_nd @ w_dv
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    probs[np.arange(len(probs)), targets.reshape(-1)] -= 1
    exact = x_nd.T @ probs / len(probs)
    exact = exact.T if tie else exact

    error = np.abs(np.asarray(chunked, np.float64) - exact).max() / np.abs(exact).max()
    assert error <= 2 ** -7, error
