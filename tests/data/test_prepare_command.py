"""`python -m spillway.data` warms the cache a run reads: its defaults are a recipe's data settings.

With a validation fraction of its own (0.01 against the recipes' 0.02) and its own
cache folder (.cache/data against .cache/spillway), the command prepared rows under
another key, and the run it was meant to prepare for tokenized the corpus again.
"""

from spillway.data.__main__ import main
from spillway.recipes.config import DataConfig
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.data_pipeline import prepare


def test_the_commands_defaults_are_a_recipes_data_settings():
    from spillway.data.__main__ import build_parser

    args, data = build_parser().parse_args([]), DataConfig()
    assert (args.source, args.text_field, args.seq_len, args.val_fraction, str(args.cache_dir), args.shard_tokens,
            args.model_type) == (data.source, data.text_field, data.seq_len, data.val_fraction, data.cache_dir,
                                 data.shard_tokens, data.tokenizer_type)


def test_a_run_reads_the_rows_the_command_prepared(tmp_path, capsys):
    source = "builtin:stdlib:200000"
    assert main(["--source", source, "--vocab-size", "512", "--seq-len", "32", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    recipe = get_recipe("tiny", [f"data.source={source}", "model.vocab_size=512", "data.seq_len=32",
                                 f"data.cache_dir={tmp_path}", "train.global_batch=4"])
    _, data = prepare(recipe)
    assert data.from_cache
