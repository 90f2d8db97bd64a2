"""Training on a mixture through the train loop: batches follow the weights, validation and metrics name each
source, and a run stopped mid-mixture and resumed equals an uninterrupted one, bit for bit.

Offline: the mixture is the embedded stdlib corpus (code) and generated prose (prose_corpus.py).
"""

import jax
import numpy as np
import pytest

from prose_corpus import write_prose
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.loop import train


pytestmark = [pytest.mark.slow]  # one module fixture training a mixture run: 40 s on 2 cores, `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    """An uninterrupted 6-step run on a 3:1 mixture, saving steps 3 and 6."""
    root = tmp_path_factory.mktemp("mixture")
    prose = write_prose(root / "prose")

    def recipe(*extra):
        return get_recipe("tiny", [
            f"data.mixture=code=3:builtin:stdlib:400000,prose=1:{prose}", f"data.cache_dir={root / 'cache'}",
            "data.seq_len=32", "data.num_proc=1", "data.val_fraction=0.2", "model.vocab_size=512",
            "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
            "model.mlp_hidden=64", "model.max_seq_len=64", "train.global_batch=8", "train.steps=6",
            "train.log_every=1", "train.eval_every=3", "train.eval_batches=1", "train.sample_tokens=0",
            "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2", f"checkpoint.dir={root / 'run'}",
            "checkpoint.every_steps=3", *extra])

    return recipe, train(recipe(), progress=False)


def rows(result, key):
    return {row["step"]: row[key] for row in result.history if key in row}


def test_training_follows_the_weights_and_validation_names_each_source(mixture_run):
    _, result = mixture_run
    # 8 rows of 32 tokens per step, 3:1: 6 code rows and 2 prose rows every step.
    assert rows(result, "tokens/code") == {step: step * 6 * 32 for step in range(1, 7)}
    assert rows(result, "tokens/prose") == {step: step * 2 * 32 for step in range(1, 7)}
    (evaluation,) = [row for row in result.history if "val_loss" in row and row["step"] == 6]
    assert {"val_loss/code", "val_loss/prose"} <= set(evaluation)
    # val_loss is the mixture's: the weights' average of the per-source losses.
    expected = 0.75 * evaluation["val_loss/code"] + 0.25 * evaluation["val_loss/prose"]
    assert evaluation["val_loss"] == pytest.approx(expected, rel=1e-12)
    assert evaluation["val_loss/code"] != pytest.approx(evaluation["val_loss/prose"], abs=1e-3)
    losses = rows(result, "loss")
    assert losses[6] < losses[1]


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_resumed_mid_mixture_equals_the_uninterrupted_run(mixture_run):
    recipe, straight = mixture_run
    # Go back to step 3 (step 6 is set aside) and train 4..6 again from the saved mixture state
    # (without validation, which changes nothing the training does and costs a compile).
    resumed = train(recipe("train.resume_step=3", "train.eval_every=0"), progress=False)
    assert resumed.final_step == 6
    for key in ("loss", "tokens/code", "tokens/prose"):
        again = rows(resumed, key)
        assert sorted(again) == [4, 5, 6]
        assert again == {step: value for step, value in rows(straight, key).items() if step > 3}, key
    for a, b in zip(jax.tree.leaves(straight.model), jax.tree.leaves(resumed.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
