"""Documents are tokenized as the family's tokenizer does: with the BOS its post-processor or add_bos_token puts first.

The tokenizer.json files are built here with the `tokenizers` library (no
network): one whose post-processor puts a BOS before the text (Llama 3 style,
a TemplateProcessing inside a Sequence), one that puts none (GPT-2 / Qwen
style). transformers, where installed, is the independent reference for the
ids a document starts with. A sentencepiece model trained here adds no BOS
unless asked (`with_bos`, the recipe's data.add_bos).
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from spillway.data import BOS_ID, load_tokenizer, prepare_tokens, train_tokenizer
from spillway.data.encoding import encode_texts
from spillway.recipes.train.tokenization_record import describe_kept_bos, recorded_bos
from tiny_corpus import make_documents

EOS = "<|endoftext|>"
BOS = "<|begin_of_text|>"
TEXTS = ["def f(x):\n    return x\n", "the model reads tokens"]


@pytest.fixture(scope="module")
def bpe() -> RustTokenizer:
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS, BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(make_documents(30, seed=2), trainer)
    return tokenizer


def save(bpe: RustTokenizer, directory, *, adds_bos: bool, config: dict | None = None):
    """tokenizer.json (a BOS template in its post-processor, or the byte-level one alone) and its config."""
    tokenizer = RustTokenizer.from_str(bpe.to_str())
    byte_level = processors.ByteLevel(trim_offsets=False)
    if adds_bos:   # as Llama 3's: Sequence[ByteLevel, TemplateProcessing("<|begin_of_text|> $A")]
        template = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                 special_tokens=[(BOS, bpe.token_to_id(BOS))])
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config or {"eos_token": EOS, "bos_token": BOS}))
    return directory


def documents(tokenizer, texts=TEXTS) -> list[list[int]]:
    tokens, lengths = encode_texts(tokenizer, texts, np.dtype(np.int32))
    return [list(map(int, part)) for part in np.split(tokens, np.cumsum(lengths)[:-1])]


def test_a_post_processor_that_adds_a_bos_puts_it_before_every_document(bpe, tmp_path):
    tokenizer = load_tokenizer(save(bpe, tmp_path / "bos", adds_bos=True))
    bos = bpe.token_to_id(BOS)
    assert tokenizer.adds_bos and tokenizer.bos_id == bos and tokenizer.document_prefix() == [bos]
    for text, ids in zip(TEXTS, documents(tokenizer)):
        assert ids == [bos] + tokenizer.encode([text])[0] + [tokenizer.eos_id]   # one BOS, then one EOS
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "bos" / "tokenizer.json"))
    assert [ids[:-1] for ids in documents(tokenizer)] == reference(TEXTS)["input_ids"]


def test_a_post_processor_without_a_bos_adds_none_and_keeps_the_fingerprint_caches_were_made_with(bpe, tmp_path):
    import hashlib

    tokenizer = load_tokenizer(save(bpe, tmp_path / "plain", adds_bos=False))
    assert not tokenizer.adds_bos and tokenizer.document_prefix() == []
    assert documents(tokenizer) == [ids + [tokenizer.eos_id] for ids in tokenizer.encode(TEXTS)]
    before_bos = hashlib.sha256(f"{tokenizer.backend.to_str()}\neos={tokenizer.eos_id}".encode()).hexdigest()
    assert tokenizer.fingerprint == before_bos   # packed caches of no-BOS runs stay valid
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "plain" / "tokenizer.json"))
    assert [ids[:-1] for ids in documents(tokenizer)] == reference(TEXTS)["input_ids"]


def test_add_bos_token_in_tokenizer_config_decides_over_the_post_processor(bpe, tmp_path):
    off = load_tokenizer(save(bpe, tmp_path / "off", adds_bos=True,
                              config={"eos_token": EOS, "bos_token": BOS, "add_bos_token": False}))
    on = load_tokenizer(save(bpe, tmp_path / "on", adds_bos=False,
                             config={"eos_token": EOS, "bos_token": BOS, "add_bos_token": True}))
    assert not off.adds_bos and on.adds_bos and on.document_prefix() == [bpe.token_to_id(BOS)]
    nameless = load_tokenizer(save(bpe, tmp_path / "nameless", adds_bos=False,
                                   config={"eos_token": EOS, "add_bos_token": True}))
    with pytest.raises(ValueError, match="has no BOS token"):
        nameless.document_prefix()


def test_the_choice_survives_pickling_saving_and_fingerprints_differ(bpe, tmp_path):
    with_bos = load_tokenizer(save(bpe, tmp_path / "bos", adds_bos=True))
    without = with_bos.with_bos(False)
    assert with_bos.adds_bos and not without.adds_bos and with_bos.fingerprint != without.fingerprint
    assert pickle.loads(pickle.dumps(without)).adds_bos is False   # worker processes tokenize the same way
    without.save_to_directory(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())["add_bos_token"] is False
    assert load_tokenizer(tmp_path / "run").fingerprint == without.fingerprint
    assert recorded_bos(tmp_path / "run") is False and recorded_bos(tmp_path / "nowhere") is None


def test_a_sentencepiece_model_trained_here_adds_no_bos_unless_asked(tmp_path):
    tokenizer = train_tokenizer(make_documents(40, seed=1), vocab_size=400, cache_dir=tmp_path / "spm")
    assert not tokenizer.adds_bos and documents(tokenizer)[0][0] != BOS_ID
    asked = tokenizer.with_bos(True)
    assert all(ids[0] == BOS_ID and ids.count(BOS_ID) == 1 for ids in documents(asked))
    assert asked.fingerprint != tokenizer.fingerprint


def test_packed_rows_start_documents_with_the_bos(bpe, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(make_documents(12, seed=3)):
        (folder / f"{i:02d}.txt").write_text(text)
    tokenizer = load_tokenizer(save(bpe, tmp_path / "bos", adds_bos=True))
    packed = prepare_tokens(str(folder), tokenizer, seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.1)
    flat = np.concatenate([packed.train.reshape(-1), packed.val.reshape(-1)])
    after_eos = flat[1:][flat[:-1] == tokenizer.eos_id]
    assert after_eos.size and (after_eos == tokenizer.bos_id).all()   # each next document starts with the BOS
    plain = prepare_tokens(str(folder), tokenizer.with_bos(False), seq_len=16, cache_dir=tmp_path / "cache",
                           val_fraction=0.1)
    assert not plain.from_cache and not (plain.train == tokenizer.bos_id).any()   # another cache, no BOS


def test_a_resumed_run_from_before_bos_keeps_none_and_says_so_once(bpe, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # what spillway wrote before it added BOS: no add_bos_token
    (run_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": BOS}))
    tokenizer = load_tokenizer(save(bpe, tmp_path / "bos", adds_bos=True))
    kept = recorded_bos(run_dir)
    assert kept is False
    line = describe_kept_bos(tokenizer.with_bos(kept), kept, None)
    assert line is not None and "\n" not in line and "without a BOS" in line and BOS in line
    assert describe_kept_bos(tokenizer, True, None) is None   # the same choice as a new run: nothing to say
