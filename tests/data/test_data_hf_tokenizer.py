"""Hugging Face tokenizer.json and checkpoint-style sentencepiece tokenizers behind the one Tokenizer interface.

The tokenizers are built here, offline: a small byte-level BPE trained with the
`tokenizers` library and saved the way transformers saves one
(`PreTrainedTokenizerFast.save_pretrained`: tokenizer.json plus
tokenizer_config.json naming the EOS), and the session's sentencepiece model.
transformers, where installed, is the independent reference for the ids.
"""

import json
import pickle

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from spillway.data import (
    HFTokenizer,
    NoEosTokenError,
    SentencePieceTokenizer,
    check_vocab,
    load_tokenizer,
    prepare_tokens,
)
from tiny_corpus import make_documents

EOS = "<|endoftext|>"
BOS = "<|begin|>"
TEXTS = ["def f(x):\n\n        return x  # naïve ✓ 漢字\n", "  leading spaces", "the model reads tokens"]


def train_bpe(vocab_size: int = 300) -> RustTokenizer:
    """A byte-level BPE (GPT-2 / Llama 3 style): every byte is a piece, so any text round-trips."""
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(make_documents(30, seed=2), trainer)
    return tokenizer


@pytest.fixture(scope="module")
def bpe() -> RustTokenizer:
    return train_bpe()


@pytest.fixture
def hf_dir(bpe, tmp_path):
    """tokenizer.json + tokenizer_config.json as transformers writes them."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf"
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=BOS) \
        .save_pretrained(directory)
    return directory


def test_tokenizer_json_loads_from_dir_or_file_and_matches_transformers(hf_dir, bpe):
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(hf_dir)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.path == hf_dir / "tokenizer.json"
    assert load_tokenizer(hf_dir / "tokenizer.json").fingerprint == tokenizer.fingerprint
    assert tokenizer.vocab_size == bpe.get_vocab_size()
    assert tokenizer.eos_id == bpe.token_to_id(EOS) and tokenizer.bos_id == bpe.token_to_id(BOS)
    reference = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer.encode(TEXTS)
    assert ids == reference(TEXTS, add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode(x) for x in ids] == TEXTS
    assert tokenizer.eos_id == reference.eos_token_id


def test_checkpoint_post_processor_and_truncation_never_apply(bpe, tmp_path):
    # Llama 3's tokenizer.json prepends BOS; some checkpoints ship truncation settings.
    bpe = RustTokenizer.from_str(bpe.to_str())
    bpe.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bpe.token_to_id(BOS))])
    bpe.enable_truncation(max_length=4)
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    ids = load_tokenizer(tmp_path).encode([TEXTS[0]])[0]
    assert len(ids) > 4 and ids[0] != bpe.token_to_id(BOS)


def test_pickles_as_json_text_and_rebuilds_lazily(hf_dir):
    tokenizer = load_tokenizer(hf_dir)
    tokenizer.encode(["warm it up"])
    assert set(tokenizer.__getstate__()) == {"json_text", "path", "special"}
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone._tokenizer is None
    assert clone.encode(TEXTS) == tokenizer.encode(TEXTS) and clone.eos_id == tokenizer.eos_id


def test_eos_comes_from_the_files_beside_or_is_a_clear_error(bpe, tmp_path):
    bpe.save(str(tmp_path / "tokenizer.json"))
    bare = load_tokenizer(tmp_path)   # loading works; asking for the EOS does not
    with pytest.raises(NoEosTokenError, match="no end-of-sequence token.*tokenizer_config.json"):
        bare.eos_id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_tokenizer(tmp_path).eos_id == 7
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS}}))
    assert load_tokenizer(tmp_path).eos_id == bpe.token_to_id(EOS)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
        load_tokenizer(tmp_path).eos_id


def test_vocab_size_counts_added_tokens_and_check_vocab_names_both_sizes(bpe, tmp_path):
    bpe = RustTokenizer.from_str(bpe.to_str())
    bpe.add_special_tokens(["<|extra|>"])
    bpe.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    assert tokenizer.vocab_size == bpe.token_to_id("<|extra|>") + 1
    check_vocab(tokenizer, tokenizer.vocab_size)
    with pytest.raises(ValueError, match=f"\\({tokenizer.vocab_size} ids\\) is larger than the model's "
                                         f"embedding \\(256 rows\\).*tokenizer.json"):
        check_vocab(tokenizer, 256)


def test_sentencepiece_model_in_a_checkpoint_directory(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.model")
    plain = load_tokenizer(tmp_path)
    assert isinstance(plain, SentencePieceTokenizer)
    assert plain.eos_id == tokenizer.eos_id and plain.fingerprint == tokenizer.fingerprint
    # A sibling config naming another EOS piece wins, and changes what packing depends on.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    renamed = load_tokenizer(tmp_path / "tokenizer.model")
    assert renamed.eos_id == tokenizer.bos_id != tokenizer.eos_id
    assert renamed.fingerprint != tokenizer.fingerprint
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "not-a-piece"}))
    with pytest.raises(ValueError, match="'not-a-piece' is not a piece"):
        load_tokenizer(tmp_path).eos_id


def test_directory_lookup_prefers_tokenizer_json_and_names_what_is_missing(hf_dir, tokenizer, tmp_path):
    tokenizer.save(hf_dir / "tokenizer.model")   # Mistral-style repos ship both
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer: neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="junk.json.*not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "junk.json")


@pytest.mark.parametrize("kind", ["hf", "spm"])
def test_save_to_directory_round_trips_special_tokens(kind, hf_dir, tokenizer, tmp_path):
    original = load_tokenizer(hf_dir) if kind == "hf" else tokenizer
    original.save_to_directory(tmp_path / "run")
    loaded = load_tokenizer(tmp_path / "run")
    assert type(loaded) is type(original)
    assert (loaded.eos_id, loaded.bos_id, loaded.vocab_size) == (original.eos_id, original.bos_id,
                                                                  original.vocab_size)
    assert loaded.fingerprint == original.fingerprint
    assert loaded.encode(TEXTS) == original.encode(TEXTS)


def test_packing_with_a_tokenizer_json(hf_dir, text_folder, tmp_path):
    tokenizer = load_tokenizer(hf_dir)
    packed = prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=tmp_path / "cache",
                            val_fraction=0.1)
    rows = packed.train
    assert rows.max() < tokenizer.vocab_size
    assert (rows == tokenizer.eos_id).sum() > 0   # documents end with the EOS from tokenizer_config.json
    again = prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert again.from_cache


def test_a_saved_copy_keeps_what_transformers_reads_beside_the_tokenizer(bpe, tmp_path):
    """A run's copy of a Hugging Face tokenizer kept only EOS, BOS and add_bos_token: AutoTokenizer then took
    the model family's class (a Gemma 2 export failed to load), lost the pad token, and a model fine-tuned on
    text lost its chat template."""
    transformers = pytest.importorskip("transformers")
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    source = tmp_path / "hf"
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=BOS, pad_token=EOS,
                                         chat_template=template).save_pretrained(source)
    load_tokenizer(source).with_bos(False).save_to_directory(tmp_path / "run")
    original = transformers.AutoTokenizer.from_pretrained(source)
    copy = transformers.AutoTokenizer.from_pretrained(tmp_path / "run")
    assert type(copy) is type(original)
    assert (copy.pad_token, copy.eos_token, copy.bos_token) == (original.pad_token, EOS, BOS)
    assert copy.chat_template == original.chat_template == template
    saved = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert saved["add_bos_token"] is False   # this tokenizer's own choice still wins
    for name in ("special_tokens_map.json", "chat_template.jinja"):   # whichever transformers wrote
        assert (tmp_path / "run" / name).is_file() == (source / name).is_file()


def test_a_tokenizer_saved_over_one_of_another_kind_is_the_one_read_back(hf_dir, tokenizer, tmp_path):
    # A run folder whose first attempt (data.tokenizer a tokenizer.json) was killed before its first step, then
    # trained with a sentencepiece model: the resume read the stale tokenizer.json, which a directory offers first.
    run = tmp_path / "run"
    load_tokenizer(hf_dir).save_to_directory(run)
    tokenizer.save_to_directory(run)
    assert not (run / "tokenizer.json").exists()
    assert load_tokenizer(run).fingerprint == tokenizer.fingerprint
