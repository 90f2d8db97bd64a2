"""`python -m spillway.data` warms the cache a run reads: its defaults are a recipe's data settings.

With a validation fraction of its own (0.01 against the recipes' 0.02) and its own
cache folder (.cache/data against .cache/spillway), the command prepared rows under
another key, and the run it was meant to prepare for tokenized the corpus again.
"""

import json

from spillway.data.__main__ import main
from spillway.recipes.config import DataConfig
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.data_pipeline import prepare


def test_the_commands_defaults_are_a_recipes_data_settings():
    from spillway.data.__main__ import build_parser

    args, data = build_parser().parse_args([]), DataConfig()
    assert (args.source, args.text_field, args.seq_len, args.val_fraction, str(args.cache_dir), args.shard_tokens,
            args.model_type, args.split) == (data.source, data.text_field, data.seq_len, data.val_fraction,
                                             data.cache_dir, data.shard_tokens, data.tokenizer_type, data.split)


def test_a_run_reads_the_rows_the_command_prepared(tmp_path, capsys):
    source = "builtin:stdlib:200000"
    assert main(["--source", source, "--vocab-size", "512", "--seq-len", "32", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    recipe = get_recipe("tiny", [f"data.source={source}", "model.vocab_size=512", "data.seq_len=32",
                                 f"data.cache_dir={tmp_path}", "train.global_batch=4"])
    _, data = prepare(recipe)
    assert data.from_cache


def test_a_split_the_source_does_not_hold_is_one_line_before_anything_runs(tmp_path, capsys):
    import pytest

    from spillway.data.sources import MissingSplitError
    from spillway.recipes.train.preflight import missing_inputs

    for split in ("train", "test"):
        (tmp_path / f"{split}.txt").write_text(f"the {split} document")
    assert main(["--source", str(tmp_path), "--split", "dev", "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err == (f"python -m spillway.data: error: corpus {str(tmp_path)!r} has no split 'dev'; its splits: "
                   f"test, train (data.split, or --split, chooses one)\n")
    with pytest.raises(MissingSplitError, match="its splits: test, train"):   # `spillway train`: not "missing"
        missing_inputs(DataConfig(source=str(tmp_path), split="dev"))
    assert missing_inputs(DataConfig(source=str(tmp_path), split="test")) == []


def test_a_resumed_run_on_another_split_is_a_changed_corpus():
    from spillway.recipes.train.corpus_record import corpus_differences

    before = {"text_field": "text", "sources": {}}   # recorded before data.split: the train split
    assert corpus_differences(before, {**before, "split": "train"}) == []
    assert corpus_differences(before, {**before, "split": "test"}) == ["data.split was 'train', now 'test'"]


def test_a_hub_source_it_cannot_reach_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    """Offline, `datasets` retried for 24 s before failing; the command asks the Hub once, up front (here not at
    all: HF_HUB_OFFLINE), and a path that is not there is said to be none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert main(["--source", "owner/corpus", "--vocab-size", "512", "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'owner/corpus' is no file or folder" in err
    assert "HF_HUB_OFFLINE is set" in err and "hf download owner/corpus --repo-type dataset" in err
    assert not (tmp_path / ".cache").exists()   # nothing prepared


def test_a_resumed_run_whose_chat_template_file_was_edited_is_a_changed_corpus(tmp_path):
    """An edited data.chat_template file re-rendered the rows of a resumed run without a word."""
    from spillway.data.chat_template import BUILTIN_TEMPLATES
    from spillway.recipes.train.corpus_record import corpus_differences, describe_corpus

    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}, '
                                          '{"role": "assistant", "content": "a"}]}\n')
    template = tmp_path / "t.jinja"
    template.write_text(BUILTIN_TEMPLATES["spillway"])
    recipe = get_recipe("tiny", ["data.format=chat", f"data.source={tmp_path / 'chats.jsonl'}",
                                 f"data.chat_template={template}"])
    before = describe_corpus(recipe)
    assert corpus_differences(before, describe_corpus(recipe)) == []
    template.write_text(BUILTIN_TEMPLATES["spillway"].replace("User", "Usr"))
    assert corpus_differences(before, describe_corpus(recipe)) == [
        f"data.chat_template {str(template)!r}: its template text was edited"]
    template.unlink()
    assert "is gone or unreadable" in corpus_differences(before, describe_corpus(recipe))[0]
    builtin = get_recipe("tiny", ["data.format=chat", f"data.source={tmp_path / 'chats.jsonl'}",
                                  "data.chat_template=chatml"])
    assert corpus_differences(before, describe_corpus(builtin)) == [
        f"data.chat_template was {str(template)!r}, now 'chatml'"]
    legacy = {key: value for key, value in before.items() if key != "chat_template"}   # a record from before
    assert corpus_differences(legacy, describe_corpus(recipe)) == []


def test_ctrl_c_is_one_line_and_says_the_work_is_kept(monkeypatch, capsys):
    """It was a KeyboardInterrupt traceback from inside sentencepiece."""
    import spillway.data.__main__ as command

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(command, "prepare_and_report", interrupted)
    assert command.main([]) == command.EXIT_INTERRUPTED
    assert capsys.readouterr().err.splitlines() == [
        "python -m spillway.data: interrupted (the shards written so far are kept: the same command resumes)"]


def test_the_same_files_in_another_order_are_a_changed_corpus():
    """A new user's finding: a link that moved a folder's files in the reading order repacked every row, and the
    resumed run went on from its saved position in other rows without a word (the record compared the files as a
    set)."""
    from spillway.recipes.train.corpus_record import corpus_differences

    files = {"/c/m.jsonl": [10, 1], "/c/sub/b.jsonl": [20, 2]}
    before = {"text_field": "text", "sources": {"corpus": {"source": "/c", "files": files}}}
    moved = {"text_field": "text", "sources": {"corpus": {"source": "/c", "files": dict(reversed(files.items()))}}}
    assert corpus_differences(before, json.loads(json.dumps(before))) == []   # the order survives the JSON file
    assert corpus_differences(before, moved) == ["the same files are read in another order now (first moved: "
                                                 "/c/sub/b.jsonl)"]
