"""Tokenizer training, caching, pickling, loading and the vocabulary check."""

import pickle

import pytest
import sentencepiece as spm

from spillway.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SentencePieceTokenizer,
    check_vocab,
    default_corpus_files,
    load_documents,
    load_tokenizer,
    padded_vocab_size,
    train_tokenizer,
)
from spillway.layers.errors import DataError
from tiny_corpus import make_documents


def test_trained_tokenizer_has_fixed_special_ids_and_round_trips(tokenizer):
    assert tokenizer.vocab_size == 400
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (
        PAD_ID,
        UNK_ID,
        BOS_ID,
        EOS_ID,
    )
    # Indentation, blank lines, characters never seen in training (byte fallback).
    texts = ["def f(x):\n\n        return x  # naïve ✓ 漢字\n", "  leading spaces", "the model"]
    encoded = tokenizer.encode(texts)
    assert len(encoded) == 3 and all(isinstance(i, int) for ids in encoded for i in ids)
    assert [tokenizer.decode(ids) for ids in encoded] == texts
    assert UNK_ID not in {i for ids in encoded for i in ids}


def test_encode_refuses_a_bare_string(tokenizer):
    with pytest.raises(TypeError, match="list of strings"):
        tokenizer.encode("the model")


def test_pickles_as_proto_bytes_and_rebuilds_lazily(tokenizer):
    tokenizer.encode(["warm the processor"])
    state = tokenizer.__getstate__()
    assert set(state) == {"model_proto", "path", "special"}
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone._processor is None
    assert clone.fingerprint == tokenizer.fingerprint
    assert clone.encode(["the model reads"]) == tokenizer.encode(["the model reads"])


def test_second_training_call_loads_from_cache(tmp_path, monkeypatch):
    documents = make_documents(30, seed=2)
    first = train_tokenizer(documents, vocab_size=380, cache_dir=tmp_path)
    assert first.path is not None and first.path.parent == tmp_path

    def refuse(*args, **kwargs):
        raise AssertionError("trained again instead of loading the cache")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", refuse)
    second = train_tokenizer(documents, vocab_size=380, cache_dir=tmp_path)
    assert second.fingerprint == first.fingerprint
    with pytest.raises(AssertionError, match="trained again"):
        train_tokenizer(documents, vocab_size=390, cache_dir=tmp_path)  # new settings: new key


def test_training_is_deterministic_without_cache():
    documents = make_documents(30, seed=3)
    a = train_tokenizer(documents, vocab_size=380)
    b = train_tokenizer(documents, vocab_size=380)
    assert a.fingerprint == b.fingerprint


def test_unigram_and_no_byte_fallback():
    # Unigram needs more varied text than the tiny corpus to fill even a small vocabulary.
    documents = [path.read_text() for path in default_corpus_files(max_bytes=100_000)]
    unigram = train_tokenizer(documents, vocab_size=500, model_type="unigram")
    assert unigram.vocab_size == 500
    assert unigram.decode(unigram.encode([documents[0]])[0]) == documents[0]
    # its ties are broken by float rounding over the whole text: a long document is never encoded in pieces
    assert not unigram.splits_exactly_before_spaces
    bpe = train_tokenizer(make_documents(40, seed=4), vocab_size=300, byte_fallback=False)
    assert bpe.vocab_size == 300
    assert bpe.decode(bpe.encode(["the model reads"])[0]) == "the model reads"


def test_trains_on_a_slice_of_the_stdlib_corpus(tmp_path):
    documents = load_documents("builtin:stdlib:1000000", cache_dir=tmp_path / "hf")
    tokenizer = train_tokenizer(documents, vocab_size=1024, cache_dir=tmp_path)
    texts = documents["text"]
    encoded = tokenizer.encode(texts, num_threads=2)
    assert [tokenizer.decode(ids) for ids in encoded[:5]] == texts[:5]
    utf8_bytes = sum(len(text.encode()) for text in texts)
    assert utf8_bytes / sum(map(len, encoded)) > 2.5  # it learned real pieces, not bytes


def test_vocab_too_small_for_the_characters_is_explained():
    with pytest.raises(ValueError, match="vocab_size=20 is too small: this corpus needs at least 45 pieces"):
        train_tokenizer(make_documents(10), vocab_size=20, byte_fallback=False)


@pytest.mark.parametrize("vocab_size", [1, 3, 270, 353])
def test_vocab_too_small_for_the_fixed_pieces_is_explained_before_the_corpus_is_read(vocab_size):
    """vocab_size 1-3 stopped in sentencepiece with "INTERNAL: src/trainer_interface.cc(827) [insert_id(...)]"."""
    def never_read():
        raise AssertionError("the corpus was read")
        yield

    with pytest.raises(ValueError, match=rf"vocab_size={vocab_size} is too small to train a tokenizer: its 4 special "
                                         rf"ids, 256 byte pieces .* need at least 354 pieces"):
        train_tokenizer(never_read(), vocab_size=vocab_size)
    assert train_tokenizer(make_documents(10), vocab_size=355).vocab_size == 355


def test_vocab_too_large_for_the_corpus_is_explained():
    with pytest.raises(ValueError, match="vocab_size=20000 is too large for this corpus.*at most \\d+"):
        train_tokenizer(make_documents(10), vocab_size=20000)


def test_corpus_too_small_for_the_vocabulary_is_one_error_with_its_size():
    """Two lines of text: sentencepiece's own check (a sample of <= 100 lines) must not be what the user sees."""
    with pytest.raises(DataError, match=r"vocab_size=2048 is too large for this corpus: sentencepiece can build "
                                        r"at most \d+ pieces from its 25 characters \(2 lines\)") as error:
        train_tokenizer(["def f(x):\n    return x + 1\n"], vocab_size=2048)
    assert "\n" not in str(error.value)


def test_a_corpus_of_100_lines_or_fewer_trains_when_the_vocabulary_fits():
    """sentencepiece refuses input_sentence_size <= 100; a short corpus must still train."""
    documents = make_documents(1)
    assert sum(len(text.splitlines()) for text in documents) <= 100
    assert train_tokenizer(documents, vocab_size=380).vocab_size == 380


def test_empty_training_text_is_rejected():
    with pytest.raises(ValueError, match="no non-empty text"):
        train_tokenizer(["", "   \n\n"], vocab_size=400)


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="model_type must be one of"):
        train_tokenizer(make_documents(2), vocab_size=300, model_type="wordpiece")


def test_save_and_load(tokenizer, tmp_path):
    path = tokenizer.save(tmp_path / "tok.model")
    loaded = load_tokenizer(path)
    assert loaded.fingerprint == tokenizer.fingerprint
    assert loaded.path == path


def test_load_missing_or_invalid_model_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.model.*does not exist"):
        load_tokenizer(tmp_path / "absent.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model.*not a sentencepiece model"):
        load_tokenizer(junk)


def test_check_vocab(tokenizer):
    check_vocab(tokenizer, 400)
    check_vocab(tokenizer, padded_vocab_size(400))  # 512: padded embeddings are fine
    expected = "tokenizer vocabulary \\(400 ids\\) is larger than the model's embedding \\(256 rows\\)"
    with pytest.raises(ValueError, match=expected):
        check_vocab(tokenizer, 256)
    # a fine-tune's embedding comes with its weights: growing model.vocab_size is no advice there (it went in a
    # circle with the hf: check, which wants the checkpoint's vocab_size)
    with pytest.raises(ValueError, match="than the embedding of the weights hf:base brings \\(256 rows\\): those "
                                         "weights were not trained with this tokenizer") as refused:
        check_vocab(tokenizer, 256, weights_from="hf:base")
    assert "vocab_size" not in str(refused.value)


def test_padded_vocab_size():
    assert padded_vocab_size(400) == 512
    assert padded_vocab_size(512) == 512
    assert padded_vocab_size(32000, multiple=64) == 32000


def test_tokenizer_repr_names_size(tokenizer):
    assert repr(tokenizer).startswith("SentencePieceTokenizer(vocab_size=400")
    assert isinstance(SentencePieceTokenizer(tokenizer.model_proto).vocab_size, int)


def test_an_unreadable_tokenizer_config_says_what_to_do(tmp_path):
    from spillway.data.tokenizer import read_special_tokens

    (tmp_path / "tokenizer_config.json").write_text("nope")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not readable JSON: .*; fix it, or copy it again"):
        read_special_tokens(tmp_path)
