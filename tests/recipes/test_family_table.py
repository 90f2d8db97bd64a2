"""benchmarks/family_table.py's rows: each names a recipe that builds at its row's batch and sequence, and
every registered family has a row (the compiles themselves are the benchmark, not a test)."""

import pytest

from benchmarks import family_table
from spillway.models.registry import family_names
from spillway.recipes.registry import get_recipe


@pytest.mark.parametrize("name, model, seq_len", family_table.ROWS, ids=[row[0] for row in family_table.ROWS])
def test_each_row_builds_at_batch_one(name, model, seq_len):
    recipe = get_recipe(name, family_table.row_overrides(seq_len))
    assert (recipe.train.global_batch, recipe.data.seq_len) == (1, seq_len)
    assert recipe.model.max_seq_len >= seq_len


def test_every_family_has_a_row():
    assert {get_recipe(name).family for name, _, _ in family_table.ROWS} == set(family_names())


def test_an_unknown_recipe_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        family_table.parse_args(["--recipes", "gpt2_124m,llama9_1t"])
    assert "unknown recipes ['llama9_1t']" in capsys.readouterr().err
