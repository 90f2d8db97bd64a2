"""Corpus files a new user may have: binary files in a text folder, a .jsonl whose text field mixes types.
Each is named (file, and line where there is one), instead of advice about something else."""

from __future__ import annotations

import json
import os

import pytest

from spillway.data import prepare_tokens, stream_documents, train_tokenizer
from spillway.layers.errors import DataError


def test_a_binary_file_in_a_text_corpus_is_named_not_a_vocab_size_problem(text_folder, tmp_path):
    binary = text_folder / "dump.txt"
    binary.write_bytes(os.urandom(20_000))
    with pytest.raises(DataError, match=rf"corpus file {binary} is not text \(\d+ NUL bytes\)"):
        train_tokenizer(stream_documents(str(text_folder)), vocab_size=400)


def test_latin1_text_with_a_few_stray_bytes_is_still_text(text_folder, tokenizer, tmp_path):
    (text_folder / "caf.txt").write_bytes(("the café " * 400).encode("latin-1"))   # one undecodable byte in 9
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=tmp_path / "a")
    (text_folder / "caf.txt").write_bytes(("the cafe " * 400 + "caf\xe9").encode("latin-1"))   # one stray byte
    assert prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=tmp_path / "b").num_documents == 13


def test_a_jsonl_with_a_number_in_its_text_field_names_file_and_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    with open(path, "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"document {i} " * 5 if i != 37 else 12345}) + "\n")
    with pytest.raises(DataError, match=rf"corpus file {path}, line 38 \(a JSON int\): field 'text' is not a string"):
        stream_documents(str(path))


def test_records_without_the_text_field_are_counted_and_the_count_is_kept_with_the_cache(tokenizer, tmp_path):
    path = tmp_path / "records.jsonl"
    with open(path, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"record {i} says something " * 4} if i % 9 else {"title": "no text"}) + "\n")
    first = prepare_tokens(str(path), tokenizer, seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert first.records_without_text == 7 and first.num_documents == 53
    again = prepare_tokens(str(path), tokenizer, seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert again.from_cache and again.records_without_text == 7


def test_the_run_says_how_many_records_it_skipped(tokenizer, tmp_path):
    from spillway.recipes.train.data_pipeline import CORPUS, TrainingData

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"text": "some words here " * 8} if i % 4 else {}) + "\n" for i in range(40)))
    packed = prepare_tokens(str(path), tokenizer, seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert "(10 records without a text field skipped)" in TrainingData({CORPUS: packed}, None).describe()


def read_texts(source) -> list[str]:
    """Every document a source streams (its read failures are raised as it is read)."""
    return [text for batch in stream_documents(str(source)).iter(batch_size=100) for text in batch["text"]]


def test_a_dataset_card_beside_jsonl_files_is_skipped_and_said(tmp_path):
    from spillway.data.sources import source_notes

    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# My dataset\n")   # every Hub dataset has one
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"text": f"record {i} " * 6}) + "\n" for i in range(9)))
    assert read_texts(tmp_path) == [f"record {i} " * 6 for i in range(9)]
    assert any("README.md (documentation beside record files)" in note for note in source_notes(str(tmp_path)))


def test_markdown_among_text_files_is_still_read(tmp_path):
    (tmp_path / "a.txt").write_text("plain text " * 9)
    (tmp_path / "b.md").write_text("# markdown " * 9)
    assert sorted(read_texts(tmp_path)) == sorted(["plain text " * 9, "# markdown " * 9])


def test_a_stray_json_among_jsonl_shards_is_named_with_its_fields(tmp_path):
    for shard in range(2):
        (tmp_path / f"shard{shard}.jsonl").write_text(
            "".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(20)))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3, "name": "x"}))
    with pytest.raises(DataError, match=r"corpus file '.*config\.json' holds records with fields \['name', "
                                        r"'vocab_size'\], the other files \['text'\]"):
        read_texts(tmp_path)


def test_a_json_list_without_the_text_field_names_the_fields_it_has(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"content": f"document {i} " * 5} for i in range(30)]))
    with pytest.raises(DataError, match=r"source '.*list\.json' has no text field 'text'; its records' fields are "
                                        r"\['content'\] \(data\.text_field names"):
        read_texts(path)


def test_chat_or_instruction_records_read_as_text_point_at_data_format(tmp_path):
    """The text-field advice alone (data.text_field=output) trained on the bare answers."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(ValueError, match=r"these look like chat records: set data.format=chat"):
        stream_documents(str(chat))
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "q", "input": "", "output": "a"}]))
    with pytest.raises(DataError, match=r"these look like instruction records: set data.format=instruct"):
        read_texts(alpaca)
