"""Chat examples tokenized by a sentencepiece model with a dummy prefix (Llama 2, Mistral v0.1: a folder with a
`tokenizer.model` and no `tokenizer.json`).

A new user's finding: every answer's first target was a lone "▁" that neither sentencepiece nor transformers
writes for the whole text ("[/INST]  def" where both give "[/INST] def"): the text was encoded in pieces cut at
the answers' edges, and the model adds its dummy prefix at the start of each piece. The reference here is
sentencepiece itself on the text between the special tokens, and transformers' apply_chat_template where it
is installed.
"""

import io
import json

import pytest

from spillway.data import load_tokenizer
from spillway.data.chat_template import resolve_chat_template
from spillway.data.sft_targets import conversation_tokens, special_token_texts

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MESSAGES = [{"role": "user", "content": "Write code that adds two numbers."},
            {"role": "assistant", "content": "def f(a, b):\n    return a + b"},
            {"role": "user", "content": "And café?"}, {"role": "assistant", "content": "naïve ✓"}]


def llama2_like(directory, **config):
    """A sentencepiece model laid out as Llama 2's (<unk> 0, <s> 1, </s> 2, dummy prefix, byte fallback, text as
    written: no normalization, whitespace kept) and its
    tokenizer_config.json (`config`: legacy, add_prefix_space as the checkpoint says them)."""
    import sentencepiece as spm

    corpus = [f"[INST] Write code that adds {i} numbers. [/INST] def f(a, b): return a + b {i}" for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus + ["café naïve"] * 20), model_writer=model, vocab_size=390, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=1.0, num_threads=1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, minloglevel=2)
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": LLAMA2_TEMPLATE,
         "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, **config}))
    return directory


# a template whose stretches after a special token start with a space (Vicuna's): transformers writes no "▁" of
# its own before one, sentencepiece's dummy prefix would make it two
SPACED_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ ' USER: ' + m['content'] }}"
                   "{% else %}{{ ' ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
CONFIGS = {"default": {}, "legacy": {"legacy": True}, "not_legacy": {"legacy": False},
           "no_prefix_space": {"add_prefix_space": False},
           "spaced_legacy": {"legacy": True, "chat_template": SPACED_TEMPLATE},
           "spaced": {"chat_template": SPACED_TEMPLATE},
           # an end of turn that absorbs the whitespace after it, or before it (added_tokens_decoder's flags)
           "eos_rstrip": {"chat_template": "{% for m in messages %}{{ m['content'] }}{{ eos_token }}\n{% endfor %}",
                          "added_tokens_decoder": {"2": {"content": "</s>", "special": True, "rstrip": True}}},
           "eos_lstrip": {"chat_template": "{% for m in messages %}{{ m['content'] }} {{ eos_token }}{% endfor %}",
                          "added_tokens_decoder": {"2": {"content": "</s>", "special": True, "lstrip": True}}}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tokenizer_dir(request, tmp_path_factory):
    return llama2_like(tmp_path_factory.mktemp("spm") / request.param, **CONFIGS[request.param])


def test_answers_are_tokenized_as_the_whole_text_is(tokenizer_dir):
    import sentencepiece as spm

    tokenizer = load_tokenizer(tokenizer_dir)
    template = resolve_chat_template(None, tokenizer_dir)
    ids, flags = conversation_tokens(template, tokenizer, MESSAGES, special_token_texts(tokenizer), "t")
    text = template.render(MESSAGES).text
    # the reference: sentencepiece on each stretch between the special tokens (which become their ids), with
    # the model's dummy prefix before it where transformers writes one: before every stretch with `legacy`,
    # before the text's first alone without (its default), none before a stretch starting with a space (which
    # becomes its "▁"), none at all with `add_prefix_space: false`
    from sentencepiece import sentencepiece_model_pb2

    prefixed = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tokenizer_dir / "tokenizer.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    unprefixed = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())

    def reference(stretch, starts_the_text):
        gets_prefix = ((config.get("legacy") or starts_the_text) and config.get("add_prefix_space", True)
                       and not stretch.startswith(" "))
        return (prefixed if gets_prefix else unprefixed).encode(stretch)

    eos_flags = config.get("added_tokens_decoder", {}).get("2", {})
    *stretches, after_last = text.removeprefix("<s>").split("</s>")
    stretches = [stretch.rstrip() if eos_flags.get("lstrip") else stretch for stretch in stretches]
    after_last = after_last.strip() if eos_flags.get("rstrip") else after_last
    stretches = [stretches[0]] + [stretch.lstrip() if eos_flags.get("rstrip") else stretch for stretch in stretches[1:]]
    assert after_last == ""
    bos = [1] if text.startswith("<s>") else []
    assert ids.tolist() == bos + sum(([*reference(stretch, not bos and index == 0), 2]
                                      for index, stretch in enumerate(stretches)), [])
    assert ids[flags].tolist().count(2) == 2             # each answer's </s> is trained
    if config["chat_template"] == LLAMA2_TEMPLATE:
        assert prefixed.piece_to_id("▁") not in ids[flags][:1].tolist()   # no "▁" of its own before the answer
        answers = prefixed.decode([i for i in ids[flags].tolist() if i != 2])
        assert answers.split() == "def f(a, b): return a + b naïve ✓".split()


def test_the_ids_are_those_transformers_gives(tokenizer_dir):
    transformers = pytest.importorskip("transformers", reason="needs transformers (the parity extra)")
    tokenizer = load_tokenizer(tokenizer_dir)
    template = resolve_chat_template(None, tokenizer_dir)
    ids, _ = conversation_tokens(template, tokenizer, MESSAGES, special_token_texts(tokenizer), "t")
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert ids.tolist() == list(reference.apply_chat_template(MESSAGES, tokenize=True, return_dict=False))
    # messages that start a stretch (right after a special token) with a "▁" of their own, or a space: no
    # dummy prefix before them
    bare = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    odd = [{"role": "user", "content": "\u2581hi"}, {"role": "assistant", "content": "\u2581 yo"},
           {"role": "user", "content": " so"}, {"role": "assistant", "content": "ok"}]
    expected = reference.apply_chat_template(odd, chat_template=bare, tokenize=True, return_dict=False)
    (tokenizer_dir.parent / "bare.jinja").write_text(bare)
    template = resolve_chat_template(str(tokenizer_dir.parent / "bare.jinja"), tokenizer_dir)
    ids, _ = conversation_tokens(template, tokenizer, odd, special_token_texts(tokenizer), "t")
    assert ids.tolist() == list(expected)


def test_documents_are_encoded_as_transformers_encodes_them(tokenizer_dir):
    """`add_prefix_space: false` wrote the dummy prefix all the same (a new user's finding): 'Hello' trained as
    '▁H...' where transformers gives 'H...'."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (the parity extra)")
    tokenizer = load_tokenizer(tokenizer_dir)
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for text in ("Write code that adds two numbers.", "café naïve ✓\nreturn a + b"):
        (ids,) = tokenizer.encode([text])
        assert tokenizer.document_prefix() + ids == reference(text)["input_ids"]


def test_tokens_added_beside_a_sentencepiece_model_are_refused_not_split_into_characters(tmp_path):
    """A new user's finding: a Llama 2 tokenizer.model with ChatML's <|im_start|>/<|im_end|> added in
    tokenizer_config.json (ids 390 and 391, past the model's pieces) was read as the model alone: the template's
    turn markers became characters, where transformers gives each its own id. A new run given it is refused in
    one line, naming them; the model's own pieces named as added tokens (Llama 2's <unk>, <s>, </s>) are fine,
    and a run that trained with such a folder before goes on reading it (its copy loads)."""
    from spillway.data import check_no_tokens_added
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.data_pipeline import load_or_train_tokenizer

    own = {"0": {"content": "<unk>", "special": True}, "2": {"content": "</s>", "special": True}}
    check_no_tokens_added(load_tokenizer(llama2_like(tmp_path / "own", added_tokens_decoder=own)))
    added = {**own, "390": {"content": "<|im_end|>", "special": True}, "391": {"content": "<|im_start|>"}}
    folder = llama2_like(tmp_path / "chatml", added_tokens_decoder=added)
    assert load_tokenizer(folder).vocab_size == 390   # readable: a run that trained with it samples and exports
    refused = (r"add tokens that are not pieces of the sentencepiece model \('<\|im_end\|>' as 390, '<\|im_start\|>' "
               r"as 391; the model has 390 pieces\).*tokenizer.json")
    with pytest.raises(ValueError, match=refused):
        load_or_train_tokenizer(get_recipe("tiny", [f"data.tokenizer={folder}"]))
    (folder / "checkpoints").mkdir()   # the folder is a run's: its copy is what it trained with
    assert load_or_train_tokenizer(get_recipe("tiny", [f"data.tokenizer={folder}"])).vocab_size == 390
    (folder / "checkpoints").rmdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "added_tokens.json").write_text(json.dumps({"<|im_end|>": 390}))   # the older file, alone
    with pytest.raises(ValueError, match="'<\\|im_end\\|>' as 390"):
        check_no_tokens_added(load_tokenizer(folder))
