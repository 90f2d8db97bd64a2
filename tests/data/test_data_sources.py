"""Source specs: local text/json/parquet files and folders, the builtin corpus, Hub ids."""

import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import spillway.data.sources as sources_module
from spillway.layers.errors import DataError
from spillway.data import (
    HubSpec,
    default_corpus_files,
    load_documents,
    parse_hub_spec,
    source_fingerprint,
    stream_documents,
)
from spillway.data.sources import TextFileDocuments

from tiny_corpus import make_documents


def test_text_folder_gives_one_document_per_supported_file(text_folder, tmp_path):
    documents = load_documents(str(text_folder), cache_dir=tmp_path / "hf")
    assert documents.column_names == ["text"]
    expected = [
        path.read_text()
        for path in sorted(text_folder.rglob("*"))
        if path.suffix in {".txt", ".md", ".py"} and ".hidden" not in path.parts
    ]
    assert documents["text"] == expected
    assert len(documents) == 12


def test_single_text_file(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("first line\n\n  indented second\n")
    documents = load_documents(str(path), cache_dir=tmp_path / "hf")
    assert documents["text"] == ["first line\n\n  indented second\n"]


def test_builtin_stdlib_slice_matches_corpus_files(tmp_path):
    documents = load_documents("builtin:stdlib:200000", cache_dir=tmp_path / "hf")
    files = default_corpus_files(max_bytes=200_000)
    assert len(documents) == len(files)
    assert documents[0]["text"] == files[0].read_text()


def test_jsonl_with_custom_text_field(tmp_path):
    path = tmp_path / "records.jsonl"
    records = [{"id": i, "content": text} for i, text in enumerate(make_documents(3))]
    records.append({"id": 3, "content": "   "})  # blank: dropped
    path.write_text("\n".join(json.dumps(record) for record in records))
    documents = load_documents(str(path), text_field="content", cache_dir=tmp_path / "hf")
    assert documents.column_names == ["text"]
    assert documents["text"] == make_documents(3)


def test_json_folder(tmp_path):
    folder = tmp_path / "json"
    folder.mkdir()
    for index in range(2):
        (folder / f"part{index}.json").write_text(json.dumps([{"text": f"document {index}"}]))
    documents = load_documents(str(folder), cache_dir=tmp_path / "hf")
    assert documents["text"] == ["document 0", "document 1"]


def test_parquet_file_and_folder(tmp_path):
    folder = tmp_path / "parquet"
    folder.mkdir()
    for index in range(2):
        table = pa.table({"body": [f"row {index}a", f"row {index}b"], "score": [1, 2]})
        pq.write_table(table, folder / f"part{index}.parquet")
    documents = load_documents(str(folder), text_field="body", cache_dir=tmp_path / "hf")
    assert documents["text"] == ["row 0a", "row 0b", "row 1a", "row 1b"]
    single = load_documents(str(folder / "part1.parquet"), text_field="body", cache_dir=tmp_path / "hf")
    assert single["text"] == ["row 1a", "row 1b"]


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "corpus.txt"
    with pytest.raises(FileNotFoundError, match="nowhere/corpus.txt.*does not exist"):
        load_documents(str(missing))


def test_folder_without_supported_files_is_named(tmp_path):
    folder = tmp_path / "pictures"
    folder.mkdir()
    (folder / "cat.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="pictures.*holds no supported files"):
        load_documents(str(folder))


def test_unsupported_file_type_is_named(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="table.csv.*unsupported type"):
        load_documents(str(path))


def test_folder_mixing_file_kinds_is_rejected(tmp_path):
    (tmp_path / "notes.txt").write_text("text")
    (tmp_path / "records.jsonl").write_text('{"text": "json"}\n')
    with pytest.raises(ValueError, match="mixes file kinds \\(.jsonl, .txt\\).*data.mixture"):
        load_documents(str(tmp_path))


def test_corpus_of_only_empty_documents_is_rejected(tmp_path):
    folder = tmp_path / "blank"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    (folder / "b.txt").write_text(" \n\n\t")
    with pytest.raises(ValueError, match="blank.*no non-empty documents"):
        load_documents(str(folder), cache_dir=tmp_path / "hf")


def test_missing_text_field_names_field_and_columns(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"body": "hello", "id": 1}\n')
    with pytest.raises(ValueError, match="no text field 'content'.*'body'"):
        load_documents(str(path), text_field="content", cache_dir=tmp_path / "hf")


def test_non_text_field_is_rejected(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"text": "hello", "n": 1}\n')
    with pytest.raises(ValueError, match=rf"corpus file {path}, line 1 \(a JSON int\): field 'n' is not a string"):
        load_documents(str(path), text_field="n", cache_dir=tmp_path / "hf")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("hf:roneneldan/TinyStories", HubSpec("roneneldan/TinyStories")),
        ("hf:allenai/c4:en", HubSpec("allenai/c4", "en")),
        ("HuggingFaceFW/fineweb-edu", HubSpec("HuggingFaceFW/fineweb-edu")),
        ("corpus/train.jsonl", None),  # looks like a file: a missing path, not a Hub id
        ("./owner/name", None),
        ("a/b/c", None),
        ("builtin:stdlib", None),
    ],
)
def test_hub_spec_parsing(spec, expected):
    assert parse_hub_spec(spec) == expected


def test_existing_local_path_wins_over_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").mkdir()
    assert parse_hub_spec("owner/name") is None


def test_path_under_an_existing_folder_is_a_missing_path_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    assert parse_hub_spec("corpus/train") is None
    with pytest.raises(FileNotFoundError, match="corpus path 'corpus/train' does not exist"):
        load_documents("corpus/train", cache_dir=tmp_path / "hf")


def test_bare_hub_name_that_cannot_be_loaded_says_no_such_path_exists_either(tmp_path, monkeypatch):
    """Offline (as the data tests run), `datasets` refuses the Hub; the error says there is no such path either."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"data.source 'corpus/train': no such file or folder \(relative to "
                                        r".*\), and as a Hugging Face Hub dataset 'corpus/train' it could not be "
                                        r"loaded \(.*\); Hub datasets need a network") as error:
        load_documents("corpus/train", cache_dir=tmp_path / "hf")
    assert "\n" not in str(error.value)


def test_a_hub_source_is_loaded_at_the_split_asked_for(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(sources_module.datasets, "load_dataset", lambda **kwargs: asked.append(kwargs) or 1 / 0)
    with pytest.raises(DataError):
        load_documents("hf:owner/chats", split="test_sft", cache_dir=tmp_path / "hf")
    assert asked[0]["split"] == "test_sft"


def test_hub_failure_is_one_line_with_its_cause(tmp_path, monkeypatch):
    """A Hub load that fails (here: no network, simulated) names the source and the cause."""
    def unreachable(**kwargs):
        raise ConnectionError("Couldn't reach 'owner/name' on the Hub\n(LocalEntryNotFoundError)")
    monkeypatch.setattr(sources_module.datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as error:
        load_documents("hf:owner/name", cache_dir=tmp_path / "hf")
    message = str(error.value)
    assert "\n" not in message and "ConnectionError: Couldn't reach 'owner/name'" in message
    assert message.startswith("data.source 'hf:owner/name': the Hugging Face Hub dataset 'owner/name'")


@pytest.mark.parametrize("suffix,content,where", [
    (".jsonl", '{"text": "one"}\n\n{"text": "two"\n{"text": "three"}\n', "line 3: not valid JSON"),
    (".jsonl", '{"text": "one"}\n["a list"]\n', "line 2: a JSON list, not an object"),
    (".json", '[{"text": "one"},\n {"text": "two"}\n', "line 3, column 1: not valid JSON"),
])
def test_malformed_json_corpus_names_the_file_and_line(tmp_path, suffix, content, where):
    path = tmp_path / f"corpus{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match=rf"corpus file '{path}', {where}") as error:
        load_documents(str(path), cache_dir=tmp_path / "hf")
    assert "\n" not in str(error.value)


def test_malformed_hf_spec_is_rejected():
    with pytest.raises(ValueError, match="expected hf:owner/name"):
        parse_hub_spec("hf:just-a-name")


def test_hub_spec_becomes_streaming_load_dataset_call(monkeypatch):
    assert HubSpec("allenai/c4", "en").load_dataset_kwargs(split="train", streaming=True) == {
        "path": "allenai/c4",
        "name": "en",
        "split": "train",
        "streaming": True,
    }
    calls = []

    def fake_load_dataset(**kwargs):
        calls.append(kwargs)
        rows = [{"content": "a streamed document", "url": "x"}, {"content": "", "url": "y"}]
        return datasets.Dataset.from_list(rows).to_iterable_dataset()

    monkeypatch.setattr(sources_module.datasets, "load_dataset", fake_load_dataset)
    documents = load_documents("hf:owner/name:cfg", text_field="content", split="validation")
    assert calls == [
        {"path": "owner/name", "name": "cfg", "split": "validation", "streaming": True, "cache_dir": None}
    ]
    assert isinstance(documents, datasets.IterableDataset)
    assert [row["text"] for row in documents] == ["a streamed document"]


def test_fingerprint_follows_file_changes(text_folder):
    before = source_fingerprint(str(text_folder))
    assert source_fingerprint(str(text_folder)) == before
    assert source_fingerprint(str(text_folder), text_field="body") != before
    changed = text_folder / "doc00.txt"
    changed.write_text(changed.read_text() + " more")
    stat = changed.stat()
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert source_fingerprint(str(text_folder)) != before


def test_stream_with_unknown_schema_is_renamed_lazily(monkeypatch):
    def rows():
        yield {"content": "first", "url": "a"}
        yield {"content": " ", "url": "b"}
        yield {"content": "second", "url": "c"}

    def fake_load_dataset(**kwargs):
        return datasets.IterableDataset.from_generator(rows)  # column_names is None until read

    monkeypatch.setattr(sources_module.datasets, "load_dataset", fake_load_dataset)
    documents = load_documents("owner/name", text_field="content")
    assert documents.column_names is None
    assert [row["text"] for row in documents] == ["first", "second"]


def test_streamed_text_files_are_the_loaded_documents(text_folder, tmp_path):
    # Blank files are dropped, undecodable bytes replaced, Windows line ends read as "\n",
    # exactly as the loaded (Arrow) documents.
    (text_folder / "blank.txt").write_text(" \n\t")
    (text_folder / "latin1.txt").write_bytes("caf\xe9 au lait\r\nsecond line\r\n".encode("latin-1"))
    loaded = load_documents(str(text_folder), cache_dir=tmp_path / "hf")["text"]
    streamed = stream_documents(str(text_folder))
    assert isinstance(streamed, TextFileDocuments)
    texts = [text for batch in streamed.iter(batch_size=5) for text in batch["text"]]
    assert texts == loaded and len(texts) == 13
    assert "caf\ufffd au lait\nsecond line\n" in texts
    skipped = stream_documents(str(text_folder), start=4).skip(3)
    assert [text for batch in skipped.iter(batch_size=100) for text in batch["text"]] == loaded[7:]
    with pytest.raises(ValueError, match="has no text field 'body'; its columns are \\['text'\\]"):
        stream_documents(str(text_folder), text_field="body")


def test_streamed_jsonl_skips_to_its_start(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {i}"}) for i in range(7)))
    documents = stream_documents(str(path), text_field="body", start=5)
    assert [text for batch in documents.iter(batch_size=10) for text in batch["text"]] == ["document 5", "document 6"]


# Local folders as a user has them (data/local_files.py): a dataset's own splits, compressed shards, symlinked
# subfolders, empty parquet parts, `save_to_disk` folders, BOMs and legacy-encoded bytes.

def _jsonl(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


def test_a_folder_of_split_named_files_reads_the_train_split_and_says_what_it_left_out(tmp_path):
    folder = tmp_path / "splits"
    _jsonl(folder / "train.jsonl", [f"train doc {i}" for i in range(6)])
    _jsonl(folder / "test.jsonl", [f"test doc {i}" for i in range(3)])
    texts = [batch["text"] for batch in stream_documents(str(folder)).iter(batch_size=100)][0]
    assert texts == [f"train doc {i}" for i in range(6)]
    assert sources_module.source_notes(str(folder)) == [
        f"data: {folder}: reading split 'train' (1 file); left out: test (data.split chooses)"]
    assert load_documents(str(folder), split="test", cache_dir=tmp_path / "hf")["text"] == [
        f"test doc {i}" for i in range(3)]
    assert source_fingerprint(str(folder)) != source_fingerprint(str(folder), split="test")
    with pytest.raises(DataError, match=r"has no split 'validation'; its splits: test, train"):
        stream_documents(str(folder), split="validation")


def test_hub_layout_shards_and_split_subfolders_are_splits_as_datasets_names_them(tmp_path):
    hub = tmp_path / "hub"   # as `hf download` leaves ultrachat_200k
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("# a dataset card, in no split")
    for split, count in (("train_sft", 4), ("test_sft", 2)):
        pq.write_table(pa.table({"text": [f"{split} {i}" for i in range(count)]}),
                       hub / "data" / f"{split}-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"has no split 'train'; its splits: test_sft, train_sft"):
        stream_documents(str(hub))
    spec = sources_module.parse_local_spec(str(hub), "train_sft")
    assert [path.name for path in spec.files] == ["train_sft-00000-of-00001.parquet"]
    assert spec.skipped == ((hub / "README.md", "in no split"),)
    sub = tmp_path / "sub"
    _jsonl(sub / "train" / "a.jsonl", ["in train"])
    _jsonl(sub / "validation" / "a.jsonl", ["in validation"])
    assert sources_module.parse_local_spec(str(sub), "validation").files == (sub / "validation" / "a.jsonl",)


def test_compressed_files_are_read_and_a_symlinked_subfolder_is_followed(tmp_path):
    import bz2
    import gzip
    import lzma

    folder = tmp_path / "packed"
    folder.mkdir()
    import zstandard   # a dependency: SlimPajama and the Pile ship as .jsonl.zst

    for opener, suffix in ((gzip.open, ".jsonl.gz"), (bz2.open, ".jsonl.bz2"), (lzma.open, ".jsonl.xz"),
                           (zstandard.open, ".jsonl.zst")):
        with opener(folder / f"a{suffix}", "wt") as file:
            file.write(json.dumps({"text": f"from {suffix}"}) + "\n")
    _jsonl(folder / "plain.jsonl", ["plain"])
    texts = [t for batch in stream_documents(str(folder)).iter(batch_size=100) for t in batch["text"]]
    assert sorted(texts) == ["from .jsonl.bz2", "from .jsonl.gz", "from .jsonl.xz", "from .jsonl.zst", "plain"]
    linked = tmp_path / "linked"
    (linked).mkdir()
    (linked / "own.txt").write_text("own document")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with gzip.open(elsewhere / "book.txt.gz", "wt") as file:
        file.write("a book behind a link")
    os.symlink(elsewhere, linked / "books")
    os.symlink(tmp_path / "gone.txt", linked / "dangling.txt")
    os.symlink(linked / "ping.txt", linked / "pong.txt")   # two links at each other: a loop, not "dangling"
    os.symlink(linked / "pong.txt", linked / "ping.txt")
    (linked / "table.csv").write_text("a,b\n")
    texts = [t for batch in stream_documents(str(linked)).iter(batch_size=100) for t in batch["text"]]
    assert texts == ["a book behind a link", "own document"]
    assert sources_module.source_notes(str(linked)) == [
        f"data: {linked}: skipped 4 files: {linked / 'dangling.txt'} (a dangling symlink), "
        f"{linked / 'ping.txt'} (a symlink loop), {linked / 'pong.txt'} (a symlink loop) and 1 more"]


def test_a_zst_file_without_the_zstandard_package_says_so(tmp_path, monkeypatch):
    import importlib.util

    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(b"(not read)")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    with pytest.raises(DataError, match=r"zstd-compressed and the zstandard package is not installed: pip install"):
        stream_documents(str(path))


def test_an_empty_parquet_shard_is_skipped_and_counted(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(5)]}), folder / "part-0.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "part-1.parquet")
    texts = [t for batch in stream_documents(str(folder)).iter(batch_size=100) for t in batch["text"]]
    assert texts == [f"row {i}" for i in range(5)]
    assert sources_module.source_notes(str(folder)) == [
        f"data: {folder}: skipped 1 file: {folder / 'part-1.parquet'} (empty parquet, 0 rows)"]
    with pytest.raises(ValueError, match="part-1.parquet' is an empty parquet file"):
        stream_documents(str(folder / "part-1.parquet"))


def test_a_save_to_disk_folder_is_read_with_load_from_disk(tmp_path):
    dataset = datasets.Dataset.from_dict({"text": ["saved one", "saved two"], "id": [1, 2]})
    dataset.save_to_disk(str(tmp_path / "saved"))
    texts = [t for batch in stream_documents(str(tmp_path / "saved")).iter(batch_size=100) for t in batch["text"]]
    assert texts == ["saved one", "saved two"]
    datasets.DatasetDict(train=dataset, test=dataset.select([1])).save_to_disk(str(tmp_path / "dict"))
    assert load_documents(str(tmp_path / "dict"), split="test", cache_dir=tmp_path / "hf")["text"] == ["saved two"]
    assert sources_module.source_notes(str(tmp_path / "dict")) == [
        f"data: {tmp_path / 'dict'}: reading split 'train' (3 files); left out: test (data.split chooses)"]


def test_a_utf8_bom_is_no_character_of_a_text_document(tmp_path):
    folder = tmp_path / "bom"
    folder.mkdir()
    (folder / "notepad.txt").write_bytes(b"\xef\xbb\xbfwritten by notepad")
    assert next(stream_documents(str(folder)).iter(batch_size=10))["text"] == ["written by notepad"]
    assert load_documents(str(folder), cache_dir=tmp_path / "hf")["text"] == ["written by notepad"]


def test_legacy_encoded_bytes_in_a_text_file_are_named_with_their_count(tmp_path, capsys):
    folder = tmp_path / "latin"
    folder.mkdir()
    (folder / "menu.txt").write_bytes(("the caf\xe9 menu lists coffee and tea " * 10 + "tea " * 300).encode("cp1252"))
    (folder / "fine.txt").write_text("plain utf-8 text")
    texts = next(stream_documents(str(folder)).iter(batch_size=10))["text"]
    assert texts[1].count("\ufffd") == 10
    err = capsys.readouterr().err
    assert f"1 text files are not all UTF-8; 10 bytes were read as U+FFFD: {folder / 'menu.txt'} (10)" in err
    assert "iconv" in err
    (folder / "menu.txt").write_bytes(("the caf\xe9 menu " * 30).encode("cp1252"))   # above the binary threshold
    with pytest.raises(DataError, match=r"30 of its \d+ characters are not UTF-8 .*legacy encoding.*re-encode"):
        next(stream_documents(str(folder)).iter(batch_size=10))


def test_a_glob_as_the_corpus_path_says_patterns_are_not_expanded(tmp_path):
    from spillway.data.sources import parse_local_spec

    with pytest.raises(FileNotFoundError, match=r"does not exist .*; patterns are not expanded: give the folder"):
        parse_local_spec(str(tmp_path / "*.jsonl"))
