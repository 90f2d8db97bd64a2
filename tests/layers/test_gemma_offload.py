"""Every offload plan on a small stack of Gemma-style blocks gives the no-remat loss and gradients, and each preset
copies to host exactly the names it offloads.

The blocks have everything a Gemma block adds: (1 + w) RMSNorms (q/k norm too),
post-attention and post-MLP norms, soft-capped attention with a query scale,
the tanh-GELU gated MLP, and a sliding window; the model around them is the
generic DecoderLM (tied, scaled embedding). The soft-capped flash kernel runs
under every plan with the block given LayerValues (a traced window and RoPE
base inside the scanned, rematerialised body, as the family's stack hands
them over; two plans in the default suite, every one with the slow tests), and (slow)
with the window static (layer_values None). The reference attention ("xla") is checked on two plans. Sizes are odd; float32, tight tolerance (tests/no_remat_reference.py).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from no_remat_reference import PLANS, NoRematReference, plan_params
from spillway.layers import names
from spillway.layers.block import BlockConfig, BlockContext
from spillway.layers.execution import Execution
from spillway.layers.layer_values import layer_values
from spillway.layers.offload import PRESETS, Placement
from spillway.layers.stack import host_offloaded_names
from spillway.models.decoder import DecoderLM, DecoderSpec


@dataclasses.dataclass(frozen=True)
class GemmaStyleConfig:
    """A tiny family config (decoder_spec is all DecoderLM asks of it) whose blocks are Gemma-shaped."""

    impl: str = "flash"
    values: tuple | None = None     # (sliding_window, rope_theta, rope_scale) as LayerValues; None: static
    vocab_size: int = 67
    num_layers: int = 3
    max_seq_len: int = 32

    def decoder_spec(self, execution: Execution) -> DecoderSpec:
        del execution   # the block's own: the attention kernel is what these tests vary
        block = BlockConfig(d_model=20, num_heads=4, num_kv_heads=2, head_dim=6, mlp_hidden=36,
                            norm="rms_plus_one", norm_eps=1e-6, mlp_kind="geglu", qk_norm=True,
                            attn_softcap=2.0, query_scale=0.3, post_norms=True, sliding_window=5,
                            execution=Execution(attention_impl=self.impl, flash_block_size=8, init_std=0.3))
        return DecoderSpec(self.vocab_size, self.num_layers, self.max_seq_len, block, tie_embeddings=True,
                           embed_scale=math.sqrt(20))


class GemmaStyleLM(DecoderLM):
    """DecoderLM whose blocks get the config's LayerValues (the same for every layer) when it has them."""

    def hidden_states(self, tokens_bt, positions_bt, cache=None, cache_index=None):
        if self.config.values is None:
            return super().hidden_states(tokens_bt, positions_bt, cache, cache_index)
        values = layer_values(*self.config.values)
        x_btd = self.embed_tokens(tokens_bt, positions_bt)
        x_btd, new_cache = self.layers(x_btd, BlockContext(positions_bt, cache_index, values), cache)
        return self.final_norm(x_btd), new_cache


TOKENS = np.random.default_rng(3).integers(0, 67, (2, 19))
TRACED = (5, 500.0, 2.0)    # window, RoPE base, linear RoPE scale


@pytest.fixture(scope="module")
def flash_static():
    return NoRematReference(GemmaStyleLM, GemmaStyleConfig(), TOKENS)


@pytest.fixture(scope="module")
def flash_traced():
    return NoRematReference(GemmaStyleLM, GemmaStyleConfig(values=TRACED), TOKENS)


# Weights drawn at std 0.3 (so the cap bends the scores) make gradients of order 1e-2; float32 summation
# order (two scans instead of one) then moves the odd element by ~5e-7: atol 1e-6 is 1e-4 of their scale.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.slow   # the program of a uniform stack: the families' own preset tests cover it in the default run
@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_gives_the_no_remat_loss_and_gradients_flash(plan, flash_static):
    flash_static.check(plan, **TOLERANCE)


@pytest.mark.parametrize("plan", plan_params(PLANS))
def test_every_plan_gives_the_no_remat_loss_and_gradients_with_layer_values(plan, flash_traced):
    flash_traced.check(plan, **TOLERANCE)


def forward_loss(config) -> float:
    """The loss of a freshly initialised model (the same weights for every config here: same shapes, same seed)."""
    graphdef, state = nnx.split(GemmaStyleLM(config, rngs=nnx.Rngs(0), remat="save_all"))
    inputs, targets = jnp.asarray(TOKENS[:, :-1]), jnp.asarray(TOKENS[:, 1:])

    @jax.jit
    def loss(state):
        logits = nnx.merge(graphdef, state)(inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return float(loss(state))


def test_layer_values_are_what_the_blocks_use():
    """LayerValues equal to the static config give the static loss; window 5, base 500, scale 2 another."""
    static = forward_loss(GemmaStyleConfig())
    np.testing.assert_allclose(forward_loss(GemmaStyleConfig(values=(5, 10000.0, 1.0))), static, rtol=1e-6)
    assert abs(forward_loss(GemmaStyleConfig(values=TRACED)) - static) > 1e-4


@pytest.fixture(scope="module")
def xla_traced():
    return NoRematReference(GemmaStyleLM, GemmaStyleConfig(impl="xla", values=TRACED), TOKENS)


@pytest.mark.parametrize("plan", ["offload_dots", "offload_dots:1,save_dots:1,recompute_all"])
def test_plans_on_the_reference_attention(plan, xla_traced):
    xla_traced.check(plan, **TOLERANCE)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_copies_to_host_the_names_it_offloads(name):
    """A Gemma block tags every standard name, so each preset applies. Unlike a pre-norm block, the post-MLP
    norm reads MLP_OUT in the backward pass: a preset that offloads MLP_OUT copies it too."""
    model = nnx.eval_shape(lambda: GemmaStyleLM(GemmaStyleConfig(values=TRACED), rngs=nnx.Rngs(0),
                                                remat=name))
    assert model.layers.block_names == frozenset(names.ACTIVATION_NAMES)
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 9), jnp.int32)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(tokens).astype(jnp.float32) ** 2)
    found = set(host_offloaded_names(jax.make_jaxpr(jax.grad(loss))(state)))
    policy = PRESETS[name]
    assert found == (set(policy.names_with(Placement.HOST)) if policy.remat else set()), (name, found)
