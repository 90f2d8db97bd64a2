"""Gemma's tokenizer: a sentencepiece `tokenizer.model` and the `tokenizer.json` transformers makes of it.

Nothing can be downloaded, so the test trains a small sentencepiece model laid
out as Gemma's is: <pad> 0, <eos> 1, <bos> 2, <unk> 3, byte fallback (a
character the model never saw is spelled in <0x..> byte pieces), and the chat
markers as user-defined pieces. The loader reads it (data/spm_tokenizer.py),
and reads the tokenizer.json + tokenizer_config.json that transformers'
GemmaTokenizer writes from it (data/hf_tokenizer.py) with the same special ids
and the ids transformers itself gives.
"""

import io

import pytest

from spillway.data import load_tokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog. Gemma reads résumés and naïve cafés."] * 50 + \
    [f"line {i} of a tiny corpus, with the words {i * 7} and {i * 13}" for i in range(300)]
TEXT = "Gemma reads naïve ✓ <start_of_turn>"   # ✓ is in no training sentence: byte fallback


@pytest.fixture(scope="module")
def gemma_like_spm(tmp_path_factory):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=400, model_type="bpe", pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        byte_fallback=True, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], character_coverage=1.0,
        num_threads=1, minloglevel=2)
    directory = tmp_path_factory.mktemp("gemma_spm")
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return directory


def test_a_gemma_sentencepiece_model_is_read_with_its_special_ids(gemma_like_spm):
    tokenizer = load_tokenizer(gemma_like_spm)
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    (ids,) = tokenizer.encode([TEXT])
    assert ids[-1] == 4                                      # <start_of_turn>: one piece
    assert tokenizer.unk_id not in ids                      # the unseen character went to byte pieces
    assert tokenizer.decode(ids) == TEXT


def test_the_tokenizer_json_transformers_writes_for_gemma_is_read(gemma_like_spm, tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs transformers (the parity extra)")
    reference = transformers.GemmaTokenizer.from_pretrained(gemma_like_spm)
    reference.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and not (tmp_path / "tokenizer.model").exists()
    tokenizer = load_tokenizer(tmp_path)
    assert type(tokenizer).__name__ == "HFTokenizer"
    assert (tokenizer.eos_id, tokenizer.bos_id) == (reference.eos_token_id, reference.bos_token_id) == (1, 2)
    (ids,) = tokenizer.encode([TEXT])
    assert ids == reference(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT


GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
                  "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
                  "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def test_gemmas_end_of_turn_is_trained_and_stops_generation(gemma_like_spm, tmp_path):
    """A new user's finding: with a `tokenizer.model` alone, <end_of_turn> (a special token of the config, a
    piece of the model) was no special token to spillway: never a target after an answer, no stop for
    `generate --chat`, and a warning that the template writes no end of turn."""
    import json
    import shutil

    from spillway.data.chat_template import resolve_chat_template
    from spillway.data.sft_targets import answer_end_warning, conversation_tokens, end_of_turn_ids, special_token_texts

    folder = tmp_path / "gemma"
    shutil.copytree(gemma_like_spm, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": GEMMA_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": text, "special": True} for i, text in
                                 [(0, "<pad>"), (1, "<eos>"), (2, "<bos>"), (4, "<start_of_turn>"), (5, "<end_of_turn>")]},
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}))
    tokenizer = load_tokenizer(folder)
    specials = special_token_texts(tokenizer)
    assert specials["<end_of_turn>"] == 5 and specials["<start_of_turn>"] == 4
    template = resolve_chat_template(None, folder)
    assert answer_end_warning(template, specials) is None
    assert 5 in end_of_turn_ids(template, tokenizer, specials)
    messages = [{"role": "user", "content": "Gemma reads"}, {"role": "assistant", "content": "naïve cafés"}]
    ids, flags = conversation_tokens(template, tokenizer, messages, specials, "t")
    targets = ids[flags].tolist()
    assert targets[-1] == 5 and tokenizer.decode(targets[:-1]).strip() == "naïve cafés"


@pytest.mark.parametrize("extra", [["<start_of_turn>", "<end_of_turn>"],
                                   {"sot_token": "<start_of_turn>", "eot_token": "<end_of_turn>"}],
                         ids=["list", "named"])
def test_the_special_tokens_transformers_5_names_extra_are_read_beside_a_sentencepiece_model(gemma_like_spm, tmp_path,
                                                                                              extra):
    """A new user's finding: transformers 5 writes the additional special tokens as `extra_special_tokens` (and
    reads them so); beside a `tokenizer.model` they were no special tokens to spillway, so a chat template's
    markers were encoded as text (Mistral's [INST] in four pieces, not transformers' one id) and Gemma's
    <end_of_turn> was neither trained after an answer nor a stop."""
    import json
    import shutil

    from spillway.data.chat_template import resolve_chat_template
    from spillway.data.sft_targets import conversation_tokens, end_of_turn_ids, special_token_texts

    folder = tmp_path / "gemma"
    shutil.copytree(gemma_like_spm, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": GEMMA_TEMPLATE,
        "extra_special_tokens": extra}))
    tokenizer = load_tokenizer(folder)
    specials = special_token_texts(tokenizer)
    assert specials["<end_of_turn>"] == 5 and specials["<start_of_turn>"] == 4
    template = resolve_chat_template(None, folder)
    assert 5 in end_of_turn_ids(template, tokenizer, specials)
    messages = [{"role": "user", "content": "Gemma reads"}, {"role": "assistant", "content": "naïve cafés"}]
    ids, flags = conversation_tokens(template, tokenizer, messages, specials, "t")
    assert ids.tolist().count(4) == 2 and ids[flags].tolist()[-1] == 5
