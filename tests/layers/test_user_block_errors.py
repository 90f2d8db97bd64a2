"""A user's block with a bug of its own, or state the train step cannot keep: one line naming the block.

New users' findings: a block holding a frozen nnx.Variable or BatchStat had it trained by AdamW without a word
(the step trains every variable; a counter's updates were dropped); a Dropout's RNG state, a forward() that
raised, or a Python `if` on a traced value were "internal error, please report it"; a fine-tune of a run of a
user's block, its block unset, silently became the family's block.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from spillway.layers.block import TransformerBlock
from spillway.layers.errors import ConfigError
from spillway.layers.execution import Execution
from spillway.models.registry import get_family


class FrozenBuffer(TransformerBlock):
    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.frozen_stat = nnx.BatchStat(jnp.full((cfg.d_model,), 0.5))
        self.frozen_var = nnx.Variable(jnp.full((cfg.d_model,), 0.5))


class WithDropout(TransformerBlock):
    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)


class RaisesInForward(TransformerBlock):
    def forward(self, x, ctx, cache):
        raise KeyError("my bug in forward")


class BranchesOnAValue(TransformerBlock):
    def forward(self, x, ctx, cache):
        out, cache = super().forward(x, ctx, cache)
        if jnp.mean(out) > 0:
            out = out * 2
        return out, cache


class TakesOtherArguments(TransformerBlock):
    def forward(self, x, cache):
        return super().forward(x, None, cache)


class RaisesInInit(TransformerBlock):
    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        raise RuntimeError("my bug in __init__")


@pytest.mark.parametrize("block_cls,message", [
    (FrozenBuffer, r"FrozenBuffer holds variables that are not nnx.Param: frozen_stat \(BatchStat\), frozen_var "
                   r"\(Variable\); spillway trains every variable"),
    (WithDropout, r"WithDropout holds variables that are not nnx.Param: dropout.rngs"),
    (RaisesInForward, r"RaisesInForward: calling it as block\(x_btd, ctx\) raised KeyError: 'my bug in forward'"),
    (BranchesOnAValue, r"BranchesOnAValue: calling it as block\(x_btd, ctx\) raised TracerBoolConversionError.*"
                       r"a Python `if` on a traced value: use jnp.where or lax.cond"),
    (RaisesInInit, r"RaisesInInit: its __init__ raised RuntimeError: my bug in __init__"),
    (TakesOtherArguments, r"TakesOtherArguments: calling it as block\(x_btd, ctx\) raised TypeError"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_a_users_block_with_a_bug_or_state_is_named_in_one_line(block_cls, message):
    llama = get_family("llama")
    with pytest.raises(ConfigError, match=message) as refused:
        nnx.eval_shape(lambda: llama.build(llama.config("tiny", num_layers=2), Execution(), block_cls=block_cls,
                                           rngs=nnx.Rngs(0)))
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 900
    # the return contract is named where the call itself may be at fault, not beside the forward's own error
    assert ("returns (x_btd, cache)" in str(refused.value)) == (block_cls is TakesOtherArguments)


class EmitsLoss(TransformerBlock):
    def forward(self, x, ctx, cache):
        from spillway.layers import aux_outputs

        aux_outputs.emit("loss", jnp.mean(jnp.square(x)))
        return super().forward(x, ctx, cache)


def test_an_emitted_key_that_is_a_metric_of_the_run_is_refused():
    """A new user's finding: a block emitting "loss" overwrote the loss in metrics.jsonl and TensorBoard; one
    emitting "step" overwrote the row's step, and a resume then dropped rows."""
    llama = get_family("llama")
    with pytest.raises(ConfigError, match=r"EmitsLoss: calling it .* raised ValueError: auxiliary output 'loss': a "
                                          r"key is a string other than the run's own metric names.*'myblock/loss'"):
        nnx.eval_shape(lambda: llama.build(llama.config("tiny", num_layers=2), Execution(), block_cls=EmitsLoss,
                                           rngs=nnx.Rngs(0)))


class DropsCache(TransformerBlock):
    def forward(self, x, ctx, cache):
        out, _ = super().forward(x, ctx, cache)
        return out, None


def test_a_block_that_drops_the_decoding_cache_is_named_when_decoding():
    """A new user's finding: training passed, and the closing sample (and `spillway generate`) said only "not
    enough values to unpack (expected 2, got 1)"."""
    from spillway.recipes.sampling import generate

    llama = get_family("llama")
    model = llama.build(llama.config("tiny", num_layers=2), Execution(), block_cls=DropsCache, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=r"DropsCache: forward\(\) given a decoding cache returned NoneType in its "
                                          r"place"):
        generate(model, [1, 2, 3], max_new_tokens=2)


class KeepsAnArray(TransformerBlock):
    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.slopes = jnp.linspace(0, 1, cfg.d_model)


def test_an_array_kept_as_a_plain_attribute_is_named():
    """A new user's finding: flax's "arrays cannot be passed as metadata fields", naming neither block nor
    attribute, came only once the run compiled."""
    llama = get_family("llama")
    with pytest.raises(ConfigError, match=r"KeepsAnArray keeps arrays as plain attributes \(slopes\)"):
        nnx.eval_shape(lambda: llama.build(llama.config("tiny", num_layers=2), Execution(), block_cls=KeepsAnArray,
                                           rngs=nnx.Rngs(0)))
