"""Tokenize-and-pack: row layout, EOS, validation split, dtype, the cache and its crash safety."""

import json

import datasets
import numpy as np
import pytest

import spillway.data.packing as packing_module
import spillway.data.sources as sources_module
from spillway.data import PackedData, load_documents, prepare_tokens, token_dtype


def _expected_stream(folder, tokenizer, tmp_path):
    documents = load_documents(str(folder), cache_dir=tmp_path / "expected")["text"]
    return np.concatenate([ids + [tokenizer.eos_id] for ids in tokenizer.encode(documents)])


def test_rows_are_the_eos_separated_stream_cut_into_seq_len_plus_one(text_folder, tokenizer, tmp_path):
    seq_len = 32
    packed = prepare_tokens(
        str(text_folder), tokenizer, seq_len=seq_len, val_fraction=0.1, cache_dir=tmp_path / "cache", seed=3
    )
    stream = _expected_stream(text_folder, tokenizer, tmp_path)
    rows = stream[: len(stream) // (seq_len + 1) * (seq_len + 1)].reshape(-1, seq_len + 1)

    assert not packed.from_cache
    assert packed.num_tokens == len(stream)
    assert packed.num_documents == 12
    assert np.count_nonzero(stream == tokenizer.eos_id) == 12  # one EOS after every document
    assert packed.train.dtype == np.uint16 and packed.val.dtype == np.uint16
    assert packed.train.shape[1] == packed.val.shape[1] == seq_len + 1
    assert len(packed.train) + len(packed.val) == len(rows)
    assert len(packed.val) == max(1, round(len(rows) * 0.1))
    # Validation and training rows together are the stream's rows (as a
    # multiset: the tiny corpus repeats itself) and training keeps stream order.
    as_tuples = lambda array: sorted(map(tuple, np.asarray(array).tolist()))  # noqa: E731
    assert as_tuples(np.concatenate([packed.train, packed.val])) == as_tuples(rows)
    remaining = iter(map(tuple, rows.tolist()))
    assert all(row in remaining for row in map(tuple, packed.train.tolist()))


def test_second_call_loads_the_cache_without_tokenizing(text_folder, tokenizer, tmp_path, monkeypatch):
    arguments = dict(seq_len=16, val_fraction=0.2, cache_dir=tmp_path / "cache", seed=0)
    first = prepare_tokens(str(text_folder), tokenizer, **arguments)

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was loaded and tokenized again")

    monkeypatch.setattr(packing_module, "load_documents", refuse)
    second = prepare_tokens(str(text_folder), tokenizer, **arguments)
    assert second.from_cache and not first.from_cache
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)
    with pytest.raises(AssertionError, match="tokenized again"):
        prepare_tokens(str(text_folder), tokenizer, **{**arguments, "seq_len": 8})
    with pytest.raises(AssertionError, match="tokenized again"):
        prepare_tokens(str(text_folder), tokenizer, **{**arguments, "seed": 1})


def test_split_depends_on_seed_only(text_folder, tokenizer, tmp_path):
    def split(cache, seed):
        return prepare_tokens(
            str(text_folder), tokenizer, seq_len=16, val_fraction=0.25, cache_dir=tmp_path / cache, seed=seed
        )

    a, b, c = split("a", 0), split("b", 0), split("c", 1)
    np.testing.assert_array_equal(a.val, b.val)
    assert not np.array_equal(a.val, c.val)


def test_several_processes_give_the_same_rows(text_folder, tokenizer, tmp_path):
    one = prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0, cache_dir=tmp_path / "one")
    two = prepare_tokens(
        str(text_folder), tokenizer, seq_len=16, val_fraction=0, cache_dir=tmp_path / "two", num_proc=2
    )
    assert one.val.shape == (0, 17)
    np.testing.assert_array_equal(one.train, two.train)


def test_in_memory_dataset_source(tokenizer, tmp_path):
    documents = datasets.Dataset.from_dict({"body": ["the model reads tokens " * 20] * 4, "id": [0, 1, 2, 3]})
    arguments = dict(seq_len=8, val_fraction=0, cache_dir=tmp_path, text_field="body")
    packed = prepare_tokens(documents, tokenizer, **arguments)
    assert packed.num_documents == 4
    assert prepare_tokens(documents, tokenizer, **arguments).from_cache
    with pytest.raises(ValueError, match="no text field 'text'; its columns are \\['body', 'id'\\]"):
        prepare_tokens(documents, tokenizer, seq_len=8, cache_dir=tmp_path)


def test_streamed_source_needs_and_honours_max_tokens(tokenizer, tmp_path, monkeypatch):
    def fake_load_dataset(**kwargs):
        assert kwargs["streaming"] is True
        documents = datasets.Dataset.from_dict({"text": ["the model reads tokens " * 10] * 50})
        return documents.to_iterable_dataset()

    monkeypatch.setattr(sources_module.datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(ValueError, match="'hf:owner/name' is streamed; pass max_tokens"):
        prepare_tokens("hf:owner/name", tokenizer, seq_len=8, cache_dir=tmp_path)
    packed = prepare_tokens(
        "hf:owner/name", tokenizer, seq_len=8, val_fraction=0, cache_dir=tmp_path, max_tokens=90
    )
    assert packed.num_tokens == 90 and packed.train.shape == (10, 9)


@pytest.mark.parametrize("interruption", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing_behind(text_folder, tokenizer, tmp_path, monkeypatch, interruption):
    cache = tmp_path / "cache"
    real_write = packing_module._write_array
    written = []

    def write_then_fail(path, array):
        real_write(path, array)
        written.append(path.name)
        if len(written) == 1:  # train.npy is complete, val.npy and meta.json are not
            raise interruption

    monkeypatch.setattr(packing_module, "_write_array", write_then_fail)
    with pytest.raises(type(interruption)):
        prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0.2, cache_dir=cache)
    assert written == ["train.npy"]
    assert list((cache / "packed").iterdir()) == []

    monkeypatch.setattr(packing_module, "_write_array", real_write)
    packed = prepare_tokens(str(text_folder), tokenizer, seq_len=16, val_fraction=0.2, cache_dir=cache)
    assert not packed.from_cache
    assert json.loads((packed.path / "meta.json").read_text())["val_rows"] == len(packed.val)
    assert PackedData.load(packed.path).train.shape == packed.train.shape


def test_too_short_for_a_training_row(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("the model")
    num_tokens = len(tokenizer.encode(["the model"])[0]) + 1
    with pytest.raises(
        ValueError,
        match=f"short.txt' is too short: it has {num_tokens} tokens, and one training row of "
        f"seq_len=64 need 65 tokens",
    ):
        prepare_tokens(str(path), tokenizer, seq_len=64, val_fraction=0, cache_dir=tmp_path / "cache")


def test_too_short_for_a_validation_row(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("the model reads tokens and predicts the next one")
    num_tokens = len(tokenizer.encode([path.read_text()])[0]) + 1
    seq_len = num_tokens - 1  # the stream is exactly one row
    cache = tmp_path / "cache"
    packed = prepare_tokens(str(path), tokenizer, seq_len=seq_len, val_fraction=0, cache_dir=cache)
    assert packed.train.shape == (1, num_tokens)
    with pytest.raises(
        ValueError,
        match=f"it has {num_tokens} tokens, and one training row and one validation row of "
        f"seq_len={seq_len} need {2 * num_tokens} tokens.*val_fraction=0",
    ):
        prepare_tokens(str(path), tokenizer, seq_len=seq_len, val_fraction=0.1, cache_dir=cache)


def test_argument_checks(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="val_fraction must be in \\[0, 1\\)"):
        prepare_tokens("builtin:stdlib", tokenizer, seq_len=8, val_fraction=1.0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        prepare_tokens("builtin:stdlib", tokenizer, seq_len=0, cache_dir=tmp_path)


def test_token_dtype():
    assert token_dtype(4096) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32
