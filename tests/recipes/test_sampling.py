"""recipes/sampling.py: what a sampled token may be.

A model's embedding may be larger than its tokenizer (a tokenizer of 512 pieces for a model of 2048 rows is
allowed: data/tokenizer.py check_vocab); the rows past the tokenizer have no piece to decode, and sentencepiece
raised "piece id is out of range" on them, after the run had trained (its closing sample) and in every
`spillway generate` of the run.
"""

import jax
import jax.numpy as jnp
import numpy as np

from spillway.recipes.sampling import sample_token


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
    logits = jnp.zeros((64, 16)).at[:, 12:].set(50.0)   # the rows past the tokenizer's 10 pieces score highest
    assert set(np.asarray(sample_token(logits, jax.random.key(0), 0.0, 1.0))) == {12}   # without the limit
    assert set(np.asarray(sample_token(logits, jax.random.key(0), 0.0, 1.0, vocab_limit=10))) <= set(range(10))
    for top_p in (1.0, 0.9):
        drawn = np.asarray(sample_token(logits, jax.random.key(1), 1.0, top_p, vocab_limit=10))
        assert drawn.max() < 10, drawn
    # a limit at or past the model's rows changes nothing
    np.testing.assert_array_equal(sample_token(logits, jax.random.key(2), 1.0, 1.0, vocab_limit=16),
                                  sample_token(logits, jax.random.key(2), 1.0, 1.0))


def test_a_tiny_temperature_draws_what_greedy_does():
    """(logits / T) overflowed to inf below T ~ 1e-38 and softmax of inf - inf gave NaN: garbage ids, or none."""
    logits = jax.random.normal(jax.random.key(3), (32, 50)) * 4
    greedy = np.asarray(sample_token(logits, jax.random.key(0), 0.0, 1.0))
    for temperature in (1e-30, 1e-40, 1e-45, 1e-300):
        for top_p in (1.0, 0.9):
            drawn = np.asarray(sample_token(logits, jax.random.key(1), temperature, top_p))
            np.testing.assert_array_equal(drawn, greedy, err_msg=f"temperature {temperature}, top_p {top_p}")
