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


def test_latin1_text_with_a_few_stray_bytes_is_still_text(text_folder, tokenizer, tmp_path, capsys):
    (text_folder / "caf.txt").write_bytes(("the café " * 400).encode("latin-1"))   # one undecodable byte in 9
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=tmp_path / "a")
    assert "warning" not in capsys.readouterr().err   # the error is the one line: no warning of the same bytes
    (text_folder / "caf.txt").write_bytes(("the cafe " * 400 + "caf\xe9").encode("latin-1"))   # one stray byte
    assert prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=tmp_path / "b").num_documents == 13


def test_a_jsonl_with_a_number_in_its_text_field_names_file_and_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    with open(path, "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"document {i} " * 5 if i != 37 else 12345}) + "\n")
    with pytest.raises(DataError, match=rf"corpus file {path}, line 38 \(a JSON int\): field 'text' is not a string"):
        list(stream_documents(str(path)).iter(100))   # named as the file is read


@pytest.mark.parametrize("later", ["b.jsonl", "b.parquet", "b.json"])
def test_a_number_in_a_later_file_of_several_is_named_not_trained_as_json_text(tmp_path, later):
    """With several files, `datasets` cast a later file whose field mixes types into the first file's string
    column as JSON text: no error, and every record of that file trained with quotes and escapes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spillway.data.sources import load_documents

    folder = tmp_path / "corpus"
    folder.mkdir()
    suffix = later.rsplit(".", 1)[1]
    first = [{"text": f"document {i} " * 5} for i in range(20)]
    mixed = [{"text": "line one\nline two café"}, {"text": None}, {"text": 7}]
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(first), folder / "a.parquet")
        pq.write_table(pa.table({"text": pa.array([1, 2, 3])}), folder / later)
        where = rf"{folder / later} \(a column of int64\)"
    elif suffix == "json":
        (folder / "a.json").write_text(json.dumps(first))
        (folder / later).write_text(json.dumps(mixed))
        where = rf"{folder / later}, record 2 \(a JSON int\)"
    else:
        (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
        (folder / later).write_text("".join(json.dumps(r) + "\n" for r in mixed))
        where = rf"{folder / later}, line 3 \(a JSON int\)"
    with pytest.raises(DataError, match=rf"corpus file {where}: field 'text' is not a string"):
        load_documents(str(folder), cache_dir=tmp_path / "cache")
    # the same files with strings (and nulls) everywhere read as they are
    if suffix == "parquet":
        pq.write_table(pa.table({"text": ["line one\nline two café", None]}), folder / later)
    else:
        fine = [{"text": "line one\nline two café"}, {"text": None}]
        (folder / later).write_text(json.dumps(fine) if suffix == "json" else
                                    "".join(json.dumps(r) + "\n" for r in fine))
    texts = load_documents(str(folder), cache_dir=tmp_path / "cache2")["text"]
    assert "line one\nline two café" in texts and len(texts) == 21


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
    # an empty or blank text was dropped without a word: counted too
    with open(path, "a") as f:
        f.write("".join(json.dumps({"text": text}) + "\n" for text in ("", "   ", "\n\n")))
    packed = prepare_tokens(str(path), tokenizer, seq_len=16, cache_dir=tmp_path / "cache2", val_fraction=0.1)
    assert "(10 records without a text field, 3 with an empty text skipped)" in \
        TrainingData({CORPUS: packed}, None).describe()
    # ... as is an empty text file in a folder of text files
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(30):
        (folder / f"{i}.txt").write_text(f"document {i} says some words here " * 4 if i % 10 else "\n")
    packed = prepare_tokens(str(folder), tokenizer, seq_len=16, cache_dir=tmp_path / "cache3", val_fraction=0.1)
    assert "(3 with an empty text skipped)" in TrainingData({CORPUS: packed}, None).describe()


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
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3, "name": "x"}))   # metadata: skipped
    assert len(read_texts(tmp_path)) == 40
    (tmp_path / "stray.json").write_text(json.dumps({"vocab_size": 3, "name": "x"}))
    with pytest.raises(DataError, match=r"corpus file '.*stray\.json' holds records with fields \['name', "
                                        r"'vocab_size'\], none 'text' as the other files' have"):
        read_texts(tmp_path)
    # ... named as the stray one whichever sorts first, and however many files hold the text (1 against 1)
    (tmp_path / "shard1.jsonl").unlink()
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": 1}) + "\n")
    (tmp_path / "stray.json").unlink()
    with pytest.raises(DataError, match=r"corpus file '.*a\.jsonl' holds records with fields \['id'\], none 'text'"):
        read_texts(tmp_path)


def test_a_json_list_without_the_text_field_names_the_fields_it_has(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"content": f"document {i} " * 5} for i in range(30)]))
    with pytest.raises(DataError, match=r"source '.*list\.json' has no text field 'text'; its records' fields are "
                                        r"\['content'\] \(data\.text_field names"):
        read_texts(path)


@pytest.mark.parametrize("indent", [None, 1], ids=["one_line", "indented"])
def test_records_wrapped_in_a_data_object_are_named_with_the_list_that_holds_them(tmp_path, indent):
    """{"data": [...]} (SQuAD's shape, many exports'): its one "record" is the wrapper; "its fields are ['data']"
    alone sent a user to data.text_field=data. Read as lines (one line) or through `datasets` (indented)."""
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"version": "1", "data": [{"text": f"document {i} " * 5} for i in range(30)]},
                               indent=indent))
    with pytest.raises((DataError, ValueError), match=r"has no text field 'text'.*; its records are in a list under "
                                                      r"'data': .*store that list itself \(jq '\.data' FILE"):
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


@pytest.mark.parametrize("name", ["fake.txt.gz", "cut.jsonl.gz", "fake.txt.bz2", "fake.jsonl.xz", "fake.txt.zst"])
def test_a_compressed_file_that_does_not_decompress_is_named(tmp_path, name):
    """A .gz that is not gzip, or one cut short, was "error: Not a gzipped file (b'no')", an internal error
    (EOFError, LZMAError, ZstdError), or a traceback from python -m spillway.data: none named the file."""
    import gzip

    from spillway.data.sources import load_documents

    folder = tmp_path / "corpus"
    folder.mkdir()
    plain = "plain.jsonl" if ".jsonl" in name else "plain.txt"
    (folder / plain).write_text(json.dumps({"text": "fine words"}) + "\n" if ".jsonl" in name else "fine words\n")
    if name.startswith("cut"):
        whole = gzip.compress("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(5000)).encode())
        (folder / name).write_bytes(whole[: len(whole) // 2])
    else:
        (folder / name).write_text("not compressed at all\n")
    kind = {"gz": "gzip", "bz2": "bzip2", "xz": "xz", "zst": "zstd"}[name.rsplit(".", 1)[1]]
    message = rf"corpus file {folder / name} cannot be read as {kind}: .*fetch it again, or remove its"
    with pytest.raises(DataError, match=message):
        sum(len(batch["text"]) for batch in stream_documents(str(folder)).iter(batch_size=100))
    with pytest.raises(DataError, match=message):
        load_documents(str(folder), cache_dir=tmp_path / "cache")


def test_python_m_spillway_data_on_a_cut_gzip_is_one_line(tmp_path, capsys):
    import gzip

    from spillway.data.__main__ import main

    whole = gzip.compress(("some words of text " * 20_000).encode())
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    assert main(["--source", str(tmp_path / "cut.txt.gz"), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as gzip" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_empty_tokenizer_model_is_named_as_empty(tmp_path):
    from spillway.data.spm_tokenizer import SentencePieceTokenizer

    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.model' is not a sentencepiece model: the file is empty"):
        SentencePieceTokenizer.from_file(tmp_path / "empty.model")


def test_a_saved_dataset_without_the_text_field_names_its_columns_not_its_metadata_files(tmp_path):
    """A new user's finding: a `save_to_disk` folder read with the wrong data.text_field was "corpus file
    'state.json' holds records with fields [...]: move the odd file out", advice that breaks the dataset."""
    import datasets

    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"has no text field 'text'; its columns are \['body'\]") as error:
        list(stream_documents(str(tmp_path / "saved")).iter(10))
    assert "state.json" not in str(error.value)


def test_validation_larger_than_training_is_said(tokenizer, tmp_path):
    """A new user's finding: data.max_tokens on a corpus of a few long documents gave 75 train rows and 79 val
    rows, unsaid (each document is held out whole)."""
    from spillway.recipes.train.data_pipeline import CORPUS, TrainingData

    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 400}) + "\n" for i in range(3)))
    for seed in range(20):   # a split that held a long document out
        packed = prepare_tokens(str(path), tokenizer, seq_len=16, cache_dir=tmp_path / f"c{seed}", val_fraction=0.3,
                                seed=seed)
        if packed.val.shape[0] > packed.train.shape[0]:
            break
    assert packed.val.shape[0] > packed.train.shape[0]
    assert "more val rows than train rows" in TrainingData({CORPUS: packed}, None).describe()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le"])   # Notepad's "Unicode" (with its BOM), and without
def test_utf16_text_is_named_as_utf16_not_binary(tmp_path, encoding):
    """A new user's finding: a UTF-16 file was "not text (102 NUL bytes)", and the advice was to delete a good
    file; a UTF-16 .jsonl got the cp1252 advice."""
    (tmp_path / "a.txt").write_bytes(("hello café, a whole line of text\n" * 20).encode(encoding))
    with pytest.raises(DataError, match=r"a.txt is UTF-16 text, not UTF-8: re-encode it \(iconv -f utf-16"):
        list(stream_documents(str(tmp_path)).iter(10))
    records = tmp_path / "r.jsonl"
    records.write_bytes((json.dumps({"text": "hello"}) + "\n").encode("utf-16"))
    with pytest.raises(DataError, match=r"r.jsonl.*line 1.*UTF-16.*iconv -f utf-16 -t utf-8"):
        list(stream_documents(str(records)).iter(10))


def test_hidden_files_and_folders_are_named_where_the_run_lists_what_it_skips(tmp_path):
    """A new user's finding: `.notes.txt` and `.drafts/` were left out of the corpus without a word, where other
    files a run does not read are named."""
    from spillway.data.sources import source_notes

    (tmp_path / "a.txt").write_text("read " * 9)
    (tmp_path / ".notes.txt").write_text("hidden " * 9)
    (tmp_path / ".drafts").mkdir()
    (tmp_path / ".drafts" / "x.txt").write_text("hidden too " * 9)
    assert read_texts(tmp_path) == ["read " * 9]
    (line,) = source_notes(str(tmp_path))
    assert ".notes.txt (hidden, not read)" in line and ".drafts (a hidden folder, not read)" in line
    assert "skipped 1 file and 1 folder: " in line


def test_load_documents_reads_text_files_as_a_run_does(tmp_path, capsys):
    """A new user's finding: the public load_documents read UTF-16 as mojibake, a NUL file as text, and Latin-1
    bytes without the warning that `spillway train` gives: the documents the package's example trains on."""
    from spillway.data import load_documents

    (tmp_path / "u16").mkdir()
    (tmp_path / "u16" / "a.txt").write_bytes("hello café\n".encode("utf-16"))
    with pytest.raises(DataError, match="UTF-16"):
        load_documents(str(tmp_path / "u16"), cache_dir=tmp_path / "hf")
    (tmp_path / "nul").mkdir()
    (tmp_path / "nul" / "a.txt").write_bytes(b"text\x00more text")
    with pytest.raises(DataError, match="is not text"):
        list(load_documents(str(tmp_path / "nul"), streaming=True))
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "a.txt").write_bytes(("the cafe " * 400 + "caf\xe9").encode("latin-1"))
    (tmp_path / "latin" / "b.txt").write_text("second document")
    documents = load_documents(str(tmp_path / "latin"), cache_dir=tmp_path / "hf")
    assert documents["text"] == [("the cafe " * 400 + "caf\ufffd"), "second document"]
    assert "not all UTF-8" in capsys.readouterr().err
    (tmp_path / "latin" / "b.txt").write_text("second document, edited")   # the Arrow cache follows the file
    assert load_documents(str(tmp_path / "latin"), cache_dir=tmp_path / "hf")["text"][1] == "second document, edited"


def test_a_folder_whose_few_files_are_named_for_a_split_says_why_the_rest_are_left_out(tmp_path):
    """A new user's finding: `training_manual.txt` among seven chapters made the folder a dataset of splits, and
    the chapters, named for none, were left out with only "(in no split)" to say why."""
    from spillway.data.sources import source_notes

    for name in ("chapter1.txt", "chapter2.txt", "chapter3.txt", "training_manual.txt", "test_results.txt"):
        (tmp_path / name).write_text(f"the text of {name} " * 9)
    notes = source_notes(str(tmp_path))
    assert any("(in no split)" in line and "training_manual.txt -> train" in line and "rename those named for a "
               "split" in line for line in notes), notes
