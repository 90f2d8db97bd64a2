"""The validation loss is the mean over the validation set's target tokens, not a mean of batch means.

Fine-tuning batches hold different numbers of answer tokens: a batch with 3 targets must weigh 3/23 of
the loss, not a half. The reference is each target token's cross-entropy from the model's logits
(optax, float32), averaged over every target of every batch.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from spillway.layers.sharding import create_sharded
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config
from spillway.recipes.train.batch import Batch
from spillway.recipes.train.loop_parts import token_mean
from spillway.recipes.train.step import make_eval_step


def _masked_batches(vocab):
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 17), 0, vocab), np.int32)
    mask = np.zeros((4, 16), np.float32)
    mask[0, 2:5] = 1             # batch 1 (rows 0-1): 3 targets
    mask[2, :12] = 1             # batch 2 (rows 2-3): 20 targets
    mask[3, 8:] = 1
    return [Batch(tokens[:2], mask[:2]), Batch(tokens[2:], mask[2:])], tokens, mask


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama and its validation program, compiled once for the module's 2-row batches."""
    cfg = preset_config("llama", "tiny_odd")
    model = create_sharded(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0), remat="recompute_all"))
    graphdef, params = nnx.split(model)
    return cfg, model, params, jax.jit(make_eval_step(graphdef))


def test_the_validation_loss_is_the_mean_over_every_target_token(tiny):
    cfg, model, params, eval_sums = tiny
    batches, tokens, mask = _masked_batches(cfg.vocab_size)
    sums = [tuple(float(x) for x in eval_sums(params, batch)) for batch in batches]
    assert [count for _, count in sums] == [3.0, 20.0]

    inputs = tokens[:, :-1]
    positions = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
    x_btd, _ = model.hidden_states(inputs, positions)   # eager: the reference shares no compiled program
    losses = np.asarray(optax.softmax_cross_entropy_with_integer_labels(model.logits(x_btd), tokens[:, 1:]))
    expected = float((losses * mask).sum() / mask.sum())
    assert token_mean(sums) == pytest.approx(expected, rel=1e-5)
    batch_means = [total / count for total, count in sums]
    assert abs(np.mean(batch_means) - expected) > 1e-3   # the mean of means would have failed


def test_a_text_batch_counts_every_token(tiny):
    cfg, _, params, eval_sums = tiny
    _, tokens, _ = _masked_batches(cfg.vocab_size)
    total, count = eval_sums(params, Batch(tokens[:2]))
    every, _ = eval_sums(params, Batch(tokens[:2], np.ones((2, 16), np.float32)))
    assert float(count) == 2 * 16 and float(total) == pytest.approx(float(every), rel=1e-6)


def test_batches_without_targets_weigh_nothing_and_none_at_all_is_nan():
    assert token_mean([(6.0, 3.0), (0.0, 0.0), (10.0, 1.0)]) == 4.0
    assert np.isnan(token_mean([(0.0, 0.0)])) and np.isnan(token_mean([]))
