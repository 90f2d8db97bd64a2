"""Packed examples that do not see each other: each example's logits and loss in a packed row equal its own alone.

Three examples of different lengths are packed into one row with their example ids
(segment ids) and positions restarting at 0 (recipes/train/sft_batch.py); every attention
path that takes segment ids (the blockwise kernel with small blocks, so that blocks are
skipped and shared across examples; XLA's explicit mask; Gemma 2's soft-capped scores
with a static sliding window; Gemma 3's per-layer traced windows) must give each
example the logits it gets run alone, and the masked loss over one example's targets its
loss alone. cuDNN is refused by name (layers/segment_mask.py).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from spillway.layers.errors import ConfigError
from spillway.layers.segment_mask import check_segment_support
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.sft_batch import TrainBatch, batch_from_rows, positions_in_segments, with_step_denominator
from spillway.recipes.train.step import make_loss_fn

LENGTHS = (41, 23, 36)   # longer than the Gemma recipes' 32-token window, so the window is exercised


def build(recipe_name: str, attention_impl: str):
    recipe = get_recipe(recipe_name)
    recipe = dataclasses.replace(recipe, execution=dataclasses.replace(
        recipe.execution, attention_impl=attention_impl, flash_block_size=16, dtype="float32"))
    return recipe.build_model(nnx.Rngs(0))


def packed_row(vocab: int):
    rng = np.random.default_rng(0)
    examples = [rng.integers(3, vocab, length).astype(np.int32) for length in LENGTHS]
    tokens = np.concatenate(examples)[None]
    segments = np.concatenate([np.full(length, i + 1) for i, length in enumerate(LENGTHS)])[None].astype(np.int32)
    return examples, tokens, segments


@pytest.mark.parametrize("recipe_name, attention_impl", [
    ("tiny", "flash"), ("tiny", "xla"),
    pytest.param("gemma2_tiny", "flash", marks=pytest.mark.slow), pytest.param("gemma2_tiny", "xla", marks=pytest.mark.slow),
    pytest.param("gemma3_tiny", "flash", marks=pytest.mark.slow), pytest.param("gemma3_tiny", "xla", marks=pytest.mark.slow),
])
def test_each_packed_example_gets_its_logits_alone(recipe_name, attention_impl):
    model = build(recipe_name, attention_impl)
    examples, tokens, segments = packed_row(model.spec.vocab_size)

    positions = positions_in_segments(segments)
    x, _ = jax.jit(lambda t, p, s: model.hidden_states(t, p, segment_ids_bt=s))(tokens, positions, segments)
    packed = np.asarray(model.logits(x))[0]
    start = 0
    for example in examples:
        alone = np.asarray(jax.jit(model)(example[None]))[0]
        np.testing.assert_allclose(packed[start: start + len(example)], alone, rtol=2e-4, atol=2e-4)
        start += len(example)


def test_masked_loss_of_one_packed_example_is_its_loss_alone():
    model = build("tiny", "flash")
    graphdef, params = nnx.split(model)
    examples, tokens, segments = packed_row(model.spec.vocab_size)
    rows = np.stack([tokens, np.ones_like(tokens), segments], axis=1)   # fine-tuning rows: every token a target
    batch = batch_from_rows(rows, document_mask=True)
    loss_fn = jax.jit(make_loss_fn(graphdef))
    start = 0
    for example in examples:
        only_this = np.zeros_like(batch.loss_mask)
        only_this[0, start: start + len(example) - 1] = batch.loss_mask[0, start: start + len(example) - 1]
        alone = float(loss_fn(params, TrainBatch(example[None])))
        assert float(loss_fn(params, batch._replace(loss_mask=only_this))) == pytest.approx(alone, rel=1e-5)
        start += len(example)


def test_rows_become_targets_inside_each_example_and_positions_restart():
    tokens = np.array([[5, 6, 7, 8, 9, 0, 0]])
    targets = np.array([[0, 0, 1, 0, 1, 1, 0]])
    segments = np.array([[1, 1, 1, 2, 2, 0, 0]])
    batch = batch_from_rows(np.stack([tokens, targets, segments], axis=1), document_mask=True)
    # target j is token j + 1: 7 (inside example 1) counts; 8 starts example 2 (never a target); 9 counts;
    # the padding's flag (set here on purpose) never counts.
    np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 0, 1, 0]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 2, 2, 0]])
    text = batch_from_rows(np.array([[4, 2, 5, 6, 2, 7]]), document_mask=True, eos_id=2)   # text: cut after EOS
    np.testing.assert_array_equal(text.segment_ids, [[1, 1, 2, 2, 2]])
    np.testing.assert_array_equal(text.loss_mask, [[1, 0, 1, 1, 0]])
    plain = batch_from_rows(np.array([[4, 2, 5]]), document_mask=False)   # the tokens alone: the text program
    assert isinstance(plain.tokens, np.ndarray) and plain[1:] == (None,) * 4


def test_accumulated_micro_batches_give_the_mean_over_all_the_steps_targets_and_none_is_not_nan():
    model = build("tiny", "xla")
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.spec.vocab_size, (4, 13)).astype(np.int32)
    mask = np.zeros((4, 12), np.float32)
    mask[0, :9] = 1   # micro-batch 0 (rows 0 and 2) holds 10 targets, micro-batch 1 (rows 1, 3) only 1
    mask[2, 3] = 1
    mask[1, 5] = 1
    loss_fn = jax.jit(make_loss_fn(graphdef))
    whole = float(loss_fn(params, TrainBatch(tokens, mask)))
    batch = with_step_denominator(TrainBatch(tokens, mask), 2)
    micro = [jax.tree.map(lambda x, m=m: x[m::2], batch) for m in range(2)]   # rows m, m + 2 (the train step's split)
    assert np.mean([float(loss_fn(params, part)) for part in micro]) == pytest.approx(whole, rel=1e-5)
    nothing = TrainBatch(tokens, np.zeros_like(mask))
    loss, grads = jax.jit(jax.value_and_grad(make_loss_fn(graphdef)))(params, nothing)
    assert float(loss) == 0.0 and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_cudnn_is_refused_by_name_for_packed_examples():
    with pytest.raises(ConfigError, match="attention_impl=cudnn cannot keep packed examples apart"):
        check_segment_support("cudnn")
