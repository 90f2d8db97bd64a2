"""An exported sentencepiece tokenizer encodes in transformers and `tokenizers` as the run's sentencepiece model does.

An outside review's finding: `spillway export` copied a run's tokenizer.model alone, and transformers rebuilt it
as the family's class. A gpt2_tiny export (model_type gpt2) was read as GPT-2's byte-level BPE: 6,454 of 7,640
lines of Python source got other ids than training gave them, most of them none at all; Gemma's class made a
unigram model BPE, and the `tokenizers` library could not read the folder. The export now writes the model as
a tokenizer.json (data/spm_json.py) with the generic class. The folders here are runs' tokenizer files as
training writes them (`save_to_directory`), copied by the export's own step; no weights are involved.
"""

import io
import json
import random

import pytest
import sentencepiece as spm

from spillway.data import train_tokenizer
from spillway.data.spm_tokenizer import SentencePieceTokenizer
from spillway.recipes.export import _copy_tokenizer

def make_documents(count: int, seed: int = 0) -> list[str]:
    """Prose of made-up words and indented code, distinct per document."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(60)) + f" {i}.\n\n"
            f"def step(state, batch):\n    loss = state.apply(batch)\n    return loss * {i}  # scale\n"
            for i in range(count)]


HARD = ["", " ", "   ", " a", "a ", "  a  b   c ", "\tx\t", "line1\nline2\n\n", " \n ", "    return x + 1\n",
        "日本語のテキスト", "emoji 😀🎉👍🏽 👨‍👩‍👧", "e\u0301 cafe\u0301", "ＦＵＬＬ ｗｉｄｔｈ", "ﬁne ﬂow", "① ½ x²",
        "\u00a0nbsp\u3000ideographic", "a" * 300, "<0x41> x<0x0A>y", "a\u2581b \u2581lead", "Привет мир",
        "def f(a, b):\n    return a + b  # sum\n"]


def nfkc_model() -> bytes:
    """A model trained with sentencepiece's defaults: nmt_nfkc, a dummy prefix, extra whitespace removed."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(make_documents(40) + ["ﬁne Ｆ café 日本"] * 5),
                                   model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
                                   num_threads=1, minloglevel=2)
    return model.getvalue()


MODELS = {
    "trained_bpe": lambda: train_tokenizer(make_documents(60, seed=1), vocab_size=400, num_threads=1).model_proto,
    "trained_unigram": lambda: train_tokenizer(make_documents(60, seed=1), vocab_size=400, model_type="unigram",
                                               num_threads=1).model_proto,
    "nmt_nfkc_defaults": nfkc_model,
}


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    """(the model's bytes, an export folder of a run tokenized with it, with a gpt2 config.json)."""
    proto = MODELS[request.param]()
    run = tmp_path_factory.mktemp("run")
    SentencePieceTokenizer(proto).save_to_directory(run)   # tokenizer.model and tokenizer_config.json
    out = tmp_path_factory.mktemp("export")
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))   # the class transformers would pick
    _copy_tokenizer(run, out)
    return proto, out


def test_the_tokenizers_library_reads_the_export_as_sentencepiece_encodes(exported):
    from tokenizers import Tokenizer

    proto, out = exported
    model = spm.SentencePieceProcessor(model_proto=proto)
    backend = Tokenizer.from_file(str(out / "tokenizer.json"))
    unigram = SentencePieceTokenizer(proto)._model().trainer_spec.model_type == 1
    assert type(backend.model).__name__ == ("Unigram" if unigram else "BPE")
    for text in HARD:
        ids = model.encode(text)
        assert backend.encode(text, add_special_tokens=False).ids == ids, text
        assert backend.decode(ids) == model.decode(ids), text


def test_transformers_reads_the_export_as_sentencepiece_encodes(exported):
    transformers = pytest.importorskip("transformers", reason="needs transformers (the parity extra)")
    proto, out = exported
    model = spm.SentencePieceProcessor(model_proto=proto)
    reference = transformers.AutoTokenizer.from_pretrained(out)
    assert [reference.encode(text, add_special_tokens=False) for text in HARD] == [model.encode(t) for t in HARD]
    assert reference.eos_token_id == model.eos_id()


def test_a_run_that_starts_documents_with_a_bos_exports_one(tmp_path):
    """transformers adds no BOS of its own before a tokenizer.json's text: the post-processor carries it."""
    from tokenizers import Tokenizer

    run, proto = tmp_path / "run", nfkc_model()
    SentencePieceTokenizer(proto).with_bos(True).save_to_directory(run)
    _copy_tokenizer(run, tmp_path)
    backend = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = spm.SentencePieceProcessor(model_proto=proto).bos_id()
    assert backend.encode("hi").ids == [bos] + backend.encode("hi", add_special_tokens=False).ids


def test_a_folder_naming_its_transformers_class_is_copied_as_it_is(tmp_path):
    """A Llama 2 checkpoint's tokenizer.model with its LlamaTokenizer class is read as transformers reads that
    checkpoint: no tokenizer.json is made for it."""
    run = tmp_path / "run"
    SentencePieceTokenizer(nfkc_model()).save_to_directory(run)
    config = json.loads((run / "tokenizer_config.json").read_text())
    (run / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    out = tmp_path / "out"
    out.mkdir()
    assert _copy_tokenizer(run, out) == ["tokenizer.model", "tokenizer_config.json"]
    assert not (out / "tokenizer.json").exists()


def test_a_qwen2_export_says_how_to_load_its_tokenizer(exported):
    """transformers 5 loads every qwen2 model's tokenizer as Qwen2Tokenizer (a byte-level BPE), whatever
    tokenizer_config.json names: a qwen2_tiny export's AutoTokenizer misreads the run's sentencepiece model, so the
    export's line says to load it with PreTrainedTokenizerFast, which reads the tokenizer.json as it is."""
    from spillway.recipes.export import _class_forced_note

    proto, out = exported
    copied = ["tokenizer.model", "tokenizer_config.json", "tokenizer.json (its sentencepiece model, ...)"]
    assert "PreTrainedTokenizerFast.from_pretrained(DIR)" in _class_forced_note(copied, "qwen2")
    assert _class_forced_note(copied, "gpt2") == "" and _class_forced_note(copied[:2], "qwen2") == ""
    transformers = pytest.importorskip("transformers", reason="needs transformers (the parity extra)")
    model = spm.SentencePieceProcessor(model_proto=proto)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    try:
        named = transformers.PreTrainedTokenizerFast.from_pretrained(out)
        auto = transformers.AutoTokenizer.from_pretrained(out)
    finally:
        (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    expected = [model.encode(text) for text in HARD]
    assert [named.encode(text, add_special_tokens=False) for text in HARD] == expected
    # transformers 5.25's AutoTokenizer misreads it (the reason for the note); not asserted, so that a
    # transformers that reads it as named does not fail the suite (the note is then merely unneeded)
    del auto


def test_a_run_without_a_tokenizer_config_still_names_the_generic_class(tmp_path):
    """A bare tokenizer.model in the run (no tokenizer_config.json beside it): the export writes one naming the
    class, or transformers would rebuild the model as the family's class again."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.model").write_bytes(nfkc_model())
    out = tmp_path / "out"
    out.mkdir()
    _copy_tokenizer(run, out)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
