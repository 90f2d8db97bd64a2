"""Tokenize-and-pack: rows against an in-memory reference, the document-level split, the caches, errors."""

import json

import datasets
import numpy as np
import pytest

import spillway.data.packing as packing_module
import spillway.data.sources as sources_module
from spillway.data import PackedData, document_scores, load_documents, prepare_tokens, token_dtype

from tiny_corpus import make_documents


def _reference_rows(documents, tokenizer, seq_len, val_fraction, seed, max_tokens=None):
    """The packing written the simple way: the whole corpus in memory, a document split, rows cut."""
    streams = [ids + [tokenizer.eos_id] for ids in tokenizer.encode(list(documents))]
    if max_tokens is not None:  # the head of the corpus, the last document cut short
        kept, total = [], 0
        for stream in streams:
            kept.append(stream[: max_tokens - total])
            total += len(kept[-1])
            if total >= max_tokens:
                break
        streams = kept
    row_len = seq_len + 1
    scores = document_scores(0, len(streams), seed)
    held_out = {i for i in range(len(streams)) if scores[i] < val_fraction}
    if val_fraction > 0 and sum(len(streams[i]) for i in held_out) < row_len:
        held_out, total = set(), 0  # too few: take documents by ascending score until a row is filled
        for i in sorted(range(len(streams)), key=lambda i: scores[i]):
            held_out.add(i)
            total += len(streams[i])
            if total >= row_len:
                break

    def rows(indices):
        flat = np.array([token for i in indices for token in streams[i]], dtype=np.int64)
        return flat[: len(flat) // row_len * row_len].reshape(-1, row_len)

    train = rows([i for i in range(len(streams)) if i not in held_out])
    return train, rows(sorted(held_out)), held_out


@pytest.mark.parametrize(("shard_tokens", "num_proc"), [(1 << 24, None), (700, None), (700, 2)])
def test_rows_match_the_in_memory_reference(text_folder, tokenizer, tmp_path, shard_tokens, num_proc):
    seq_len = 32
    packed = prepare_tokens(
        str(text_folder), tokenizer, seq_len=seq_len, val_fraction=0.2, cache_dir=tmp_path / "cache",
        seed=3, shard_tokens=shard_tokens, num_proc=num_proc,
    )
    documents = load_documents(str(text_folder), cache_dir=tmp_path / "hf")["text"]
    train, val, held_out = _reference_rows(documents, tokenizer, seq_len, 0.2, seed=3)

    assert not packed.from_cache
    assert packed.num_documents == 12
    assert packed.num_tokens == sum(len(ids) + 1 for ids in tokenizer.encode(documents))
    assert packed.train.dtype == np.uint16 and packed.val.dtype == np.uint16
    assert 0 < len(held_out) < 12
    np.testing.assert_array_equal(packed.train, train)
    np.testing.assert_array_equal(packed.val, val)
    meta = json.loads((packed.path / "meta.json").read_text())
    assert meta["val_documents"] == len(held_out) and meta["train_documents"] == 12 - len(held_out)


def test_a_tiny_corpus_still_gets_a_validation_row(text_folder, tokenizer, tmp_path):
    # 1% of 12 documents is expected to select none: the lowest-scoring documents fill one row.
    packed = prepare_tokens(str(text_folder), tokenizer, seq_len=64, val_fraction=0.01, cache_dir=tmp_path, seed=0)
    documents = load_documents(str(text_folder), cache_dir=tmp_path / "hf")["text"]
    train, val, held_out = _reference_rows(documents, tokenizer, 64, 0.01, seed=0)
    assert len(held_out) >= 1 and len(packed.val) >= 1
    np.testing.assert_array_equal(packed.train, train)
    np.testing.assert_array_equal(packed.val, val)


def test_validation_is_about_val_fraction_of_documents(tokenizer, tmp_path):
    documents = datasets.Dataset.from_dict({"text": make_documents(400, words_per_document=24)})
    packed = prepare_tokens(documents, tokenizer, seq_len=16, val_fraction=0.1, cache_dir=tmp_path, seed=5)
    meta = json.loads((packed.path / "meta.json").read_text())
    assert meta["val_threshold"] == 0.1
    assert 25 <= meta["val_documents"] <= 55  # 40 expected; binomial sd 6
    assert meta["val_documents"] + meta["train_documents"] == 400


def test_one_long_document_does_not_become_most_of_the_validation_set(tokenizer, tmp_path):
    """40 small documents and one holding 80% of the tokens, placed where it scores lowest: the plain threshold
    held it out (82% of the rows were validation, silently); it stays in training and validation is small ones."""
    small = make_documents(40, words_per_document=24)
    big_index = int(np.argmin(document_scores(0, 41, 0)))
    documents = small[:big_index] + [" ".join(small) * 4] + small[big_index:]
    packed = prepare_tokens(datasets.Dataset.from_dict({"text": documents}), tokenizer, seq_len=16,
                            val_fraction=0.05, cache_dir=tmp_path, seed=0)
    meta = json.loads((packed.path / "meta.json").read_text())
    assert document_scores(0, 41, 0)[big_index] < 0.05   # the threshold alone would hold it out
    assert 1 <= len(packed.val) <= 0.1 * (len(packed.train) + len(packed.val)), (len(packed.train), len(packed.val))
    assert meta["val_documents"] >= 1 and meta["train_documents"] >= 1


def test_second_call_loads_the_cache_and_repacking_reuses_the_tokens(text_folder, tokenizer, tmp_path, monkeypatch):
    arguments = dict(seq_len=16, val_fraction=0.2, cache_dir=tmp_path / "cache", seed=0)
    first = prepare_tokens(str(text_folder), tokenizer, **arguments)

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was loaded and tokenized again")

    monkeypatch.setattr(packing_module, "stream_documents", refuse)
    second = prepare_tokens(str(text_folder), tokenizer, **arguments)
    assert second.from_cache and not first.from_cache
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)
    # Another row length or split: packed again from the token shards, nothing re-read.
    repacked = prepare_tokens(str(text_folder), tokenizer, **{**arguments, "seq_len": 8})
    assert not repacked.from_cache and repacked.train.shape[1] == 9
    assert not prepare_tokens(str(text_folder), tokenizer, **{**arguments, "seed": 1}).from_cache
    # Another cap on the source is other tokens.
    with pytest.raises(AssertionError, match="tokenized again"):
        prepare_tokens(str(text_folder), tokenizer, **{**arguments, "max_tokens": 1000})


def test_split_depends_on_seed_only(text_folder, tokenizer, tmp_path):
    def split(cache, seed):
        return prepare_tokens(
            str(text_folder), tokenizer, seq_len=16, val_fraction=0.25, cache_dir=tmp_path / cache, seed=seed
        )

    a, b, c = split("a", 0), split("b", 0), split("c", 1)
    np.testing.assert_array_equal(a.val, b.val)
    assert not np.array_equal(a.val, c.val)


def test_in_memory_dataset_source(tokenizer, tmp_path):
    documents = datasets.Dataset.from_dict({"body": ["the model reads tokens " * 20] * 4, "id": [0, 1, 2, 3]})
    arguments = dict(seq_len=8, val_fraction=0, cache_dir=tmp_path, text_field="body")
    packed = prepare_tokens(documents, tokenizer, **arguments)
    assert packed.num_documents == 4
    assert prepare_tokens(documents, tokenizer, **arguments).from_cache
    with pytest.raises(ValueError, match="no text field 'text'; its columns are \\['body', 'id'\\]"):
        prepare_tokens(documents, tokenizer, seq_len=8, cache_dir=tmp_path)


def test_streamed_source_is_prepared_whole_or_capped(tokenizer, tmp_path, monkeypatch):
    texts = [f"the model reads tokens {i} " * 10 for i in range(50)]

    def fake_load_dataset(**kwargs):
        assert kwargs["streaming"] is True
        return datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()

    monkeypatch.setattr(sources_module.datasets, "load_dataset", fake_load_dataset)
    whole = prepare_tokens("hf:owner/name", tokenizer, seq_len=8, val_fraction=0, cache_dir=tmp_path, shard_tokens=300)
    assert whole.num_documents == 50
    assert whole.num_tokens == sum(len(ids) + 1 for ids in tokenizer.encode(texts))
    capped = prepare_tokens(
        "hf:owner/name", tokenizer, seq_len=8, val_fraction=0, cache_dir=tmp_path, max_tokens=90, shard_tokens=40
    )
    assert capped.num_tokens == 90 and capped.train.shape == (10, 9)
    train, _, _ = _reference_rows(texts, tokenizer, 8, 0, seed=0, max_tokens=90)
    np.testing.assert_array_equal(capped.train, train)


@pytest.mark.parametrize("interruption", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_packing_leaves_no_packed_folder(text_folder, tokenizer, tmp_path, monkeypatch, interruption):
    cache = tmp_path / "cache"
    real_write_rows = packing_module._write_rows

    def write_then_fail(shards, threshold, seed, train, val):
        train.append(shards.tokens(shards.shards[0])[:10])
        raise interruption

    monkeypatch.setattr(packing_module, "_write_rows", write_then_fail)
    with pytest.raises(type(interruption)):
        prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0.2, cache_dir=cache)
    assert [p.name for p in (cache / "packed").iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(packing_module, "_write_rows", real_write_rows)
    packed = prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0.2, cache_dir=cache)
    assert not packed.from_cache
    assert json.loads((packed.path / "meta.json").read_text())["val_rows"] == len(packed.val)
    assert PackedData.load(packed.path).train.shape == packed.train.shape


def test_a_killed_packers_temporary_folder_is_removed_by_the_next_packing(text_folder, tokenizer, tmp_path,
                                                                          monkeypatch):
    """A packer killed while it wrote (SIGKILL, the OOM killer: no clean-up runs) left its temporary folder, the
    whole rows under a hidden name, in the cache for good; every such kill left another."""
    import shutil

    cache = tmp_path / "cache"

    def killed(shards, threshold, seed, train, val):
        train.append(shards.tokens(shards.shards[0])[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(packing_module, "_write_rows", killed)
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)   # a killed process removes nothing
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0.2, cache_dir=cache)
    assert list((cache / "packed").glob(".*.tmp-*"))
    monkeypatch.undo()
    packed = prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0.2, cache_dir=cache)
    assert list((cache / "packed").glob(".*.tmp-*")) == []
    assert [p.name for p in (cache / "packed").iterdir() if not p.name.startswith(".")] == [packed.path.name]


def test_too_short_for_a_training_row(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("the model")
    num_tokens = len(tokenizer.encode(["the model"])[0]) + 1
    with pytest.raises(
        ValueError,
        match=f"short.txt' is too short: it has {num_tokens} tokens in 1 document, and one training row of "
        f"seq_len=64 need 65 tokens",
    ):
        prepare_tokens(str(path), tokenizer, seq_len=64, val_fraction=0, cache_dir=tmp_path / "cache")


def test_one_document_cannot_be_split(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("the model reads tokens and predicts the next one")
    num_tokens = len(tokenizer.encode([path.read_text()])[0]) + 1
    seq_len = num_tokens - 1  # the document is exactly one row
    cache = tmp_path / "cache"
    packed = prepare_tokens(str(path), tokenizer, seq_len=seq_len, val_fraction=0, cache_dir=cache)
    assert packed.train.shape == (1, num_tokens)
    # Its only document goes to validation whole: nothing is left to train on.
    with pytest.raises(ValueError, match=f"one training row and one validation row of seq_len={seq_len}.*"
                                         f"0 tokens train, {num_tokens} validation.*val_fraction=0"):
        prepare_tokens(str(path), tokenizer, seq_len=seq_len, val_fraction=0.1, cache_dir=cache)
    # One long file: plenty of tokens, one document. "Use a larger corpus" sent the user the wrong way.
    with pytest.raises(ValueError, match="short.txt' cannot be split into training and validation rows: its .* "
                                         "tokens are in 1 document.*a .txt file is one document.*split it into "
                                         "several files, or set data.val_fraction=0") as refused:
        prepare_tokens(str(path), tokenizer, seq_len=4, val_fraction=0.1, cache_dir=cache)
    assert "larger corpus" not in str(refused.value) and "too short" not in str(refused.value)


def test_empty_stream_is_named(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(
        sources_module.datasets, "load_dataset",
        lambda **kwargs: datasets.Dataset.from_dict({"text": ["  "]}).to_iterable_dataset(),
    )
    with pytest.raises(ValueError, match="'hf:owner/empty' holds no non-empty documents"):
        prepare_tokens("hf:owner/empty", tokenizer, seq_len=8, cache_dir=tmp_path)


def test_argument_checks(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="val_fraction must be in \\[0, 1\\)"):
        prepare_tokens("builtin:stdlib", tokenizer, seq_len=8, val_fraction=1.0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        prepare_tokens("builtin:stdlib", tokenizer, seq_len=0, cache_dir=tmp_path)


def test_token_dtype():
    assert token_dtype(4096) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
