"""Local .jsonl and .parquet corpora read for their text field alone (data/record_documents.py).

A new user's finding: a corpus whose records carry other fields in some files than in others (an `id` in one
shard), or whose later records gain a field the first 10 MB lack, was refused ("holds records with fields
[...]" / "column names don't match"), though every record had its text. The other fields are now never read.
"""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spillway.data import record_documents
from spillway.data.sources import stream_documents
from spillway.layers.errors import DataError


def texts_of(source, **kwargs):
    documents = stream_documents(str(source), **kwargs)
    return [text for batch in documents.iter(7) for text in batch["text"]], documents.records_without_text


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")


def test_files_whose_other_fields_differ_are_read_for_their_text(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"first {i}"} for i in range(30)])
    write_jsonl(tmp_path / "b.jsonl", [{"text": f"second {i}", "id": i, "meta": {"src": "x"}} for i in range(30)])
    texts, _ = texts_of(tmp_path)
    assert texts == [f"first {i}" for i in range(30)] + [f"second {i}" for i in range(30)]


def test_a_field_that_appears_after_the_first_block_and_a_record_larger_than_a_block(tmp_path, monkeypatch):
    monkeypatch.setattr(record_documents, "FIRST_BLOCK_BYTES", 1024)
    records = [{"text": f"line {i} " * 8} for i in range(200)]
    records[150] = {"text": "long " * 3000, "meta": [1, 2]}   # 15 kB: past the first block and its next size
    records[190]["id"] = 190
    write_jsonl(tmp_path / "a.jsonl", records)
    texts, _ = texts_of(tmp_path / "a.jsonl")
    assert texts == [record["text"] for record in records]
    # a restart from a later document passes over the earlier ones only
    assert texts_of(tmp_path / "a.jsonl", start=149)[0] == texts[149:]


def test_the_same_documents_and_counts_as_the_datasets_json_reader(tmp_path):
    """Where both can read a corpus, they agree: order, BOM, unicode, nulls, missing and empty texts."""
    records = [{"text": "café ☕ \u2028 line"}, {"text": None}, {"other": 1, "text": "x"}, {"text": ""},
               {"text": "   "}, {"text": "tab\tand\nnewline"}, {"text": "last"}]
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in records).encode())
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b one", "other": 2}, {"text": "b two", "other": 3}])
    texts, counts = texts_of(tmp_path)
    table = datasets.load_dataset("json", data_files=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                                  split="train", cache_dir=str(tmp_path / "cache"))
    expected = [text for text in table["text"] if text and not text.isspace()]
    assert texts == expected
    assert (counts.count, counts.empty) == (1, 2)


def test_parquet_files_of_other_columns_and_a_column_of_numbers(tmp_path):
    pq.write_table(pa.table({"text": ["p one", None, "p two"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [1, 2], "text": ["p three", ""], "url": ["u", "v"]}), tmp_path / "b.parquet")
    texts, counts = texts_of(tmp_path)
    assert texts == ["p one", "p two", "p three"] and (counts.count, counts.empty) == (1, 1)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c.parquet \(a column of int64\): field 'text' is not a string"):
        texts_of(tmp_path)


def test_what_cannot_be_read_is_named(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}] * 3)
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": "cut\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"b.jsonl', line 2: not valid JSON"):
        texts_of(tmp_path)
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": 7}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"b.jsonl, line 2 \(a JSON int\): field 'text' is not a string"):
        texts_of(tmp_path)
    (tmp_path / "b.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(DataError, match=r"b.jsonl' is empty: no record to read"):
        texts_of(tmp_path)
    # a later file none of whose records has the field: a stray file among the corpus, named by its fields
    write_jsonl(tmp_path / "b.jsonl", [{"name": "config", "version": 2}])
    with pytest.raises(DataError, match=r"b.jsonl' holds records with fields \['name', 'version'\]"):
        texts_of(tmp_path)
    # every text null is a file of records to skip, not a missing field
    write_jsonl(tmp_path / "b.jsonl", [{"text": None, "id": 1}])
    texts, counts = texts_of(tmp_path)
    assert texts == ["fine"] * 3 and counts.count == 1


def test_a_file_linked_beside_itself_is_read_once(tmp_path):
    """A new user's finding: `latest.jsonl -> dump.jsonl` in the corpus folder trained every document twice
    (and put copies in both splits), without a word."""
    from spillway.data.sources import source_notes

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "dump.jsonl", [{"text": f"doc {i}"} for i in range(5)])
    (corpus / "latest.jsonl").symlink_to("dump.jsonl")
    (corpus / "books").mkdir()
    write_jsonl(corpus / "books" / "b.jsonl", [{"text": "a book"}])
    (corpus / "current").symlink_to("books")   # a folder under two names: read under its own
    texts, _ = texts_of(corpus)
    assert texts == ["a book"] + [f"doc {i}" for i in range(5)]
    notes = " ".join(source_notes(str(corpus)))
    assert "latest.jsonl" in notes and "the same file as" in notes


def test_a_compressed_record_longer_than_the_compressed_file_is_read(tmp_path, monkeypatch):
    """A new user's finding: a 40 MB book in a 6 MB .jsonl.gz stopped at pyarrow's "straddling object": the
    block stopped growing at the compressed file's size."""
    import gzip

    monkeypatch.setattr(record_documents, "FIRST_BLOCK_BYTES", 1024)
    records = [{"text": "short"}, {"text": "word " * 20000}, {"text": "another"}]   # 100 kB, compresses to ~1 kB
    (tmp_path / "book.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    assert (tmp_path / "book.jsonl.gz").stat().st_size < 4096
    assert texts_of(tmp_path / "book.jsonl.gz")[0] == [r["text"] for r in records]


def test_json_files_beside_json_lines_are_read_for_their_text_too(tmp_path):
    """A new user's finding: one `.json` file in a folder of `.jsonl` files sent the folder back to `datasets`,
    which refused the files' other fields ("column names don't match")."""
    write_jsonl(tmp_path / "part1.jsonl", [{"text": f"doc {i}", "id": i} for i in range(3)])
    write_jsonl(tmp_path / "part2.jsonl", [{"text": "more", "url": "x"}, {"id": -1}])
    (tmp_path / "extra.json").write_text(json.dumps([{"text": "from an array", "id": 1}, {"text": None}]))
    write_jsonl(tmp_path / "lines.json", [{"text": "from lines"}])   # JSON lines named .json, as on the Hub
    texts, counts = texts_of(tmp_path)
    assert texts == ["from an array", "from lines", "doc 0", "doc 1", "doc 2", "more"] and counts.count == 2
    (tmp_path / "extra.json").write_text(json.dumps([{"text": "fine"}, {"text": 3}]))
    with pytest.raises(DataError, match=r"extra.json, record 1: a JSON int in field 'text'"):
        texts_of(tmp_path)


def test_parquet_text_of_newer_string_types_and_a_dotted_column_name(tmp_path):
    """string_view (newer writers) was refused as "not a string"; a column named "a.b" beside a struct "a" was
    read as the struct's field (an internal error)."""
    pq.write_table(pa.table({"text": pa.array(["v1", "v2"], pa.string_view())}), tmp_path / "view.parquet")
    assert texts_of(tmp_path / "view.parquet")[0] == ["v1", "v2"]
    pq.write_table(pa.table({"text": pa.array(["d1", "d2"], pa.large_string()).dictionary_encode()}),
                   tmp_path / "dict.parquet")
    assert texts_of(tmp_path / "dict.parquet")[0] == ["d1", "d2"]
    pq.write_table(pa.table({"a": pa.array([{"b": "nested"}]), "a.b": ["top level"]}), tmp_path / "dots.parquet")
    assert texts_of(tmp_path / "dots.parquet", text_field="a.b")[0] == ["top level"]


def test_an_empty_compressed_shard_and_a_field_named_in_another_normalization_are_named(tmp_path):
    import gzip
    import unicodedata

    write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}])
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(DataError, match=r"b.jsonl.gz' is empty once decompressed: no record to read; remove it"):
        texts_of(tmp_path)
    decomposed = unicodedata.normalize("NFD", "tëxt")
    write_jsonl(tmp_path / "n.jsonl", [{decomposed: "words"}])
    with pytest.raises(DataError, match=r"the field 'te\u0308xt' is that name in another Unicode normalization"):
        texts_of(tmp_path / "n.jsonl", text_field=unicodedata.normalize("NFC", "tëxt"))
    assert texts_of(tmp_path / "n.jsonl", text_field=decomposed)[0] == ["words"]


def test_a_link_to_a_folder_of_the_corpus_changes_nothing(tmp_path):
    """A new user's finding: `0-sub -> sub` read sub's files as 0-sub's, first: every document moved in the
    order (other rows, another validation split); `current -> train` took the train split's files out of it."""
    from spillway.data.sources import source_notes

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    write_jsonl(corpus / "m.jsonl", [{"text": "m"}])
    write_jsonl(corpus / "sub" / "b.jsonl", [{"text": "b"}])
    before = texts_of(corpus)[0]
    (corpus / "0-sub").symlink_to("sub")
    assert texts_of(corpus)[0] == before == ["m", "b"]
    assert "0-sub" in " ".join(source_notes(str(corpus)))
    splits = tmp_path / "splits"
    for split in ("train", "test"):
        (splits / split).mkdir(parents=True)
        write_jsonl(splits / split / "a.jsonl", [{"text": split}])
    (splits / "current").symlink_to("train")
    assert texts_of(splits)[0] == ["train"]


def test_a_lone_surrogate_in_a_json_array_is_named(tmp_path):
    """It stopped the tokenizer's training with "'utf-8' codec can't encode character '\\ud800'", no file named."""
    (tmp_path / "lone.json").write_text('[{"text": "fine"}, {"text": "lone \\ud800 x"}]')
    with pytest.raises(DataError, match=r"lone.json, record 1: a string holds a lone UTF-16 surrogate escape"):
        texts_of(tmp_path / "lone.json")


def test_a_number_in_a_pretty_printed_json_beside_json_lines_is_refused(tmp_path):
    """A new user's finding: a `.json` holding one pretty-printed object whose text is a number (or an object)
    was read through `datasets`, which made `12345` a document; the check scanned arrays only."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"document {i}"} for i in range(30)])
    (tmp_path / "b.json").write_text('{\n  "text": 12345\n}\n')
    with pytest.raises(DataError, match=r"b.json, record 0 \(a JSON int\): field 'text' is not a string"):
        texts_of(tmp_path)


def test_a_json_of_lines_names_its_bad_line_and_a_long_first_record_is_still_lines(tmp_path):
    """A new user's finding: a bad line of a JSON-lines `.json` was "line 2, column 1: not valid JSON (Extra
    data)" whatever was wrong (the whole file parsed as one document); a first record over 1 MiB made the file
    "not lines", so its folder went to `datasets` and was refused over its fields."""
    (tmp_path / "x.json").write_text('{"text": "a"}\n{"text": 7}\n')
    with pytest.raises(DataError, match=r"x.json, line 2 \(a JSON int\): field 'text' is not a string"):
        texts_of(tmp_path / "x.json")
    (tmp_path / "x.json").write_text('{"text": "a"}\n{"text": "b"},\n')
    with pytest.raises(DataError, match=r"x.json', line 2: not valid JSON"):
        texts_of(tmp_path / "x.json")
    (tmp_path / "x.json").unlink()
    long = "word " * 300_000
    (tmp_path / "a.json").write_text(json.dumps({"text": long, "id": 1}) + "\n" + json.dumps({"text": "a2"}) + "\n")
    (tmp_path / "b.json").write_text(json.dumps({"text": "b1", "meta": {"url": "x"}}) + "\n")
    assert record_documents.json_kind(tmp_path / "a.json") == "lines"
    assert texts_of(tmp_path)[0] == [long, "a2", "b1"]


def test_a_zstd_file_cut_short_is_refused_and_frames_are_all_read(tmp_path):
    """A new user's finding: a .jsonl.zst cut mid-way (an interrupted download) was read as a smaller corpus
    without a word (zstandard's reader stops at the cut), where .gz, .bz2 and .xz are refused."""
    import io

    zstandard = pytest.importorskip("zstandard")
    first = "".join(json.dumps({"text": f"first {i}"}) + "\n" for i in range(100)).encode()
    second = "".join(json.dumps({"text": f"second {i}"}) + "\n" for i in range(100)).encode()
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(out, closefd=False)
    writer.write(first)
    writer.flush(zstandard.FLUSH_BLOCK)
    cut = out.tell()
    writer.write(second)
    writer.flush(zstandard.FLUSH_FRAME)
    (tmp_path / "cut.jsonl.zst").write_bytes(out.getvalue()[:cut])
    with pytest.raises(DataError, match=r"cut.jsonl.zst cannot be read as zstd: .*cut short"):
        texts_of(tmp_path / "cut.jsonl.zst")
    (tmp_path / "cut.jsonl.zst").write_bytes(out.getvalue())
    assert len(texts_of(tmp_path / "cut.jsonl.zst")[0]) == 200
    frames = zstandard.ZstdCompressor()   # two frames one after the other, as pzstd or `cat a.zst b.zst` write
    (tmp_path / "cut.jsonl.zst").write_bytes(frames.compress(first) + frames.compress(second))
    assert texts_of(tmp_path / "cut.jsonl.zst")[0][-1] == "second 99"


def test_a_file_of_columns_as_pandas_writes_it_is_named_as_one(tmp_path):
    """A new user's finding: pandas' default DataFrame.to_json ({"text": {"0": ..., "1": ...}}) was refused with
    pyarrow's "Column(/text) changed from string to object in row 0"."""
    (tmp_path / "frame.json").write_text(json.dumps({"text": {"0": "first", "1": "second"}, "id": {"0": 1, "1": 2}}))
    with pytest.raises(DataError, match=r"frame.json, line 1 \(a JSON dict\): field 'text' is not a string.*one "
                                        r"object of columns.*orient=\"records\", lines=True"):
        texts_of(tmp_path / "frame.json")


def test_a_record_holding_its_text_key_twice_is_named_by_its_line(tmp_path):
    """A new user's finding: pyarrow's "Column(/text) was specified twice in row 0" named no line of the file."""
    (tmp_path / "dup.jsonl").write_text('{"text": "a"}\n{"text": "first", "text": "second"}\n')
    with pytest.raises(DataError, match=r"dup.jsonl', line 2: the key 'text' twice in one record; keep one"):
        texts_of(tmp_path / "dup.jsonl")
