"""Chat templates rendered as transformers renders them, and the answer tokens the loss trains on.

transformers is the reference (`apply_chat_template`: text, token ids, and with
`{% generation %}` blocks its `assistant_masks`), on a tiny byte-level BPE
tokenizer with ChatML's special tokens saved by `save_pretrained`. Without
generation blocks the answers are found turn by turn: their targets must be
each answer and the `<|im_end|>` after it, never the newline or the prompt.
The built-in template serves a sentencepiece tokenizer (no template of its own).
"""

import json

import pytest

from spillway.data import load_tokenizer
from spillway.data.chat_template import ChatTemplate, ChatTemplateError, resolve_chat_template
from spillway.data.sft_targets import (conversation_tokens, end_of_turn_ids, prompt_tokens, special_token_texts)
from spillway.layers.errors import DataError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_GENERATION = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML with tool calls as Qwen2.5 writes them (after the content, in <tool_call> markers), the tools named in a
# system turn; the generation-block twin marks the answer and its calls itself.
_TOOL_TURN = ("{% if message.content %}{{ message.content }}{% endif %}{% for call in message.tool_calls or [] %}"
              "{{ '<tool_call>' + call.function.name + ' ' + call.function.arguments + '</tool_call>' }}{% endfor %}")
_TOOLS_HEADER = ("{% if tools %}{{ '<|im_start|>system\nTools: ' + tools | map(attribute='function') | "
                 "map(attribute='name') | join(', ') + '<|im_end|>\n' }}{% endif %}")
TOOLS_CHATML = (_TOOLS_HEADER + "{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
                + _TOOL_TURN + "{% if message.role == 'tool' %}{{ ' #' + message.tool_call_id }}{% endif %}"
                "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")
TOOLS_CHATML_GENERATION = (
    _TOOLS_HEADER + "{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
    "{% if message.role == 'assistant' %}{% generation %}" + _TOOL_TURN + "{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message.content + ' #' + (message.tool_call_id or '') + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."}]
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the answer is forty two"},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "hello today"}]


def byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world how are you today the answer is forty two be brief"] * 10, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def saved_tokenizer(transformers, directory, template):
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token="<|im_end|>")
    reference.chat_template = template
    reference.save_pretrained(directory)
    return reference


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["turn_by_turn", "generation_blocks"])
def test_render_ids_and_answer_mask_equal_transformers(transformers, tmp_path, template):
    reference = saved_tokenizer(transformers, tmp_path, template)
    tokenizer = load_tokenizer(tmp_path)
    chat = resolve_chat_template(None, tmp_path)
    specials = special_token_texts(tokenizer)
    ids, flags = conversation_tokens(chat, tokenizer, CONVERSATION, specials, "test")
    expected = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=template is CHATML_GENERATION)
    assert chat.render(CONVERSATION).text == reference.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids.tolist() == list(expected["input_ids"])
    if template is CHATML_GENERATION:
        assert flags.astype(int).tolist() == list(expected["assistant_masks"])
    # Both ways the targets are the answers and the end-of-turn token written right after each, nothing else.
    assert reference.decode([i for i, f in zip(ids, flags) if f]) == \
        "the answer is forty two<|im_end|>hello today<|im_end|>"
    prompt = reference.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=True)
    assert prompt_tokens(chat, tokenizer, CONVERSATION[:2], specials) == list(prompt["input_ids"])
    assert end_of_turn_ids(chat, tokenizer, specials) == [reference.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION, TOOLS_CHATML, TOOLS_CHATML_GENERATION],
                         ids=["turn_by_turn", "generation_blocks", "tools_turn_by_turn", "tools_generation_blocks"])
def test_an_answer_of_openai_weight_0_is_context_not_a_target(transformers, tmp_path, template):
    """OpenAI's fine-tuning format keeps a turn not to learn (a wrong answer before its correction) with
    "weight": 0: it was trained like any other answer, unsaid. Its tool call, untrained too, is not refused."""
    reference = saved_tokenizer(transformers, tmp_path, template)
    tokenizer = load_tokenizer(tmp_path)
    chat = resolve_chat_template(None, tmp_path)
    specials = special_token_texts(tokenizer)
    weighted = [*CONVERSATION[:2], {**CONVERSATION[2], "weight": 0}, CONVERSATION[3],
                {**CONVERSATION[4], "weight": 1}]
    ids, flags = conversation_tokens(chat, tokenizer, weighted, specials, "test")
    assert ids.tolist() == conversation_tokens(chat, tokenizer, CONVERSATION, specials, "test")[0].tolist()
    assert reference.decode([i for i, f in zip(ids, flags) if f]) == "hello today<|im_end|>"
    if template in (TOOLS_CHATML, TOOLS_CHATML_GENERATION):
        called = [*TOOL_CONVERSATION[:1], {**TOOL_CONVERSATION[1], "weight": 0}, *TOOL_CONVERSATION[2:]]
        ids, flags = conversation_tokens(chat, tokenizer, called, specials, "test", tools=TOOLS)
        assert reference.decode([i for i, f in zip(ids, flags) if f]) == "It is sunny.<|im_end|>"


def test_train_on_prompt_makes_every_token_a_target(tmp_path, transformers):
    saved_tokenizer(transformers, tmp_path, CHATML)
    tokenizer = load_tokenizer(tmp_path)
    chat = resolve_chat_template(None, tmp_path)
    ids, flags = conversation_tokens(chat, tokenizer, CONVERSATION, special_token_texts(tokenizer), "t",
                                     train_on_prompt=True)
    assert flags.all() and len(flags) == len(ids)


def test_tojson_does_not_escape_html_and_globals_exist(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}")
    chat = resolve_chat_template(str(tmp_path / "t.jinja"), None, {"eos_token": "</s>"})
    text = chat.render([{"role": "user", "content": "<b>&"}]).text
    assert text == '[{"role": "user", "content": "<b>&"}]|4|</s>'


def test_template_errors_are_one_line_with_the_templates_own_message(tmp_path):
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="failed to render: Conversation roles must alternate$"):
        resolve_chat_template(str(tmp_path / "raises.jinja"), None).render([])
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=r"does not compile \(line 1: "):
        resolve_chat_template(str(tmp_path / "broken.jinja"), None)
    with pytest.raises(ChatTemplateError, match="neither a built-in template"):
        resolve_chat_template("no-such-template", None)


def test_a_tokenizer_without_a_template_and_none_named_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ChatTemplateError, match="has no chat template \\(no chat_template.jinja, no "
                                                "\"chat_template\" in its tokenizer_config.json\\)"):
        resolve_chat_template(None, tmp_path)


def test_chat_template_jinja_comes_first_and_errors_name_it(tmp_path):
    """transformers reads chat_template.jinja before tokenizer_config.json's entry; errors named the config
    even for a template read from the .jinja file."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config: {{ messages[0].content }}"}))
    assert resolve_chat_template(None, tmp_path).render([{"role": "user", "content": "a"}]).text == "config: a"
    (tmp_path / "chat_template.jinja").write_text("jinja: {{ messages[0].content }}")
    chat = resolve_chat_template(None, tmp_path)
    assert chat.render([{"role": "user", "content": "a"}]).text == "jinja: a"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match=f"chat template of {tmp_path / 'chat_template.jinja'} failed"):
        resolve_chat_template(None, tmp_path).render([])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="chat_template.jinja does not compile"):
        resolve_chat_template(None, tmp_path)


def test_a_render_error_names_the_record(tmp_path):
    (tmp_path / "t.jinja").write_text("{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}"
                                      "{% for m in messages %}{{ m.content }}{% endfor %}")
    chat = resolve_chat_template(str(tmp_path / "t.jinja"), None)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    with pytest.raises(ChatTemplateError, match="^record chats.jsonl, line 7: chat template .* failed to render: "
                                                "too long$"):
        conversation_tokens(chat, _SentencePieceLike(), messages, {}, "chats.jsonl, line 7")


class _SentencePieceLike:
    """Enough of a sentencepiece tokenizer (no added-token matching): one id per character."""

    bos_id, eos_id, vocab_size = 1, 2, 300

    def token_text(self, token_id):
        return {1: "<s>", 2: "</s>"}[token_id]

    def encode(self, texts):
        return [[10 + ord(c) % 250 for c in text] for text in texts]

    def encode_with_offsets(self, text, starts_the_text=True):
        return self.encode([text])[0], [(k, k + 1) for k in range(len(text))]


def test_builtin_template_targets_answers_and_eos_for_a_tokenizer_without_offsets():
    tokenizer = _SentencePieceLike()
    chat = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids, flags = conversation_tokens(chat, tokenizer, messages, special_token_texts(tokenizer), "t")
    text = chat.render(messages).text
    assert text == "<s>### User:\nhi\n\n### Assistant:\nyo</s>\n\n"
    assert ids[0] == 1 and ids.tolist().count(1) == 1   # the template's BOS, once
    assert ids[flags].tolist() == [10 + ord("y") % 250, 10 + ord("o") % 250, 2]
    assert end_of_turn_ids(chat, tokenizer, special_token_texts(tokenizer)) == [2]
    # A tokenizer that starts no document with a BOS (one spillway trained) gets none from the template either.
    without = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"})
    assert without.render(messages).text == text.removeprefix("<s>")
    # ... nor does the template text the run saves and exports, which generate --chat and transformers'
    # apply_chat_template render with the tokenizer's bos_token: a prompt starts as training started a row
    saved = ChatTemplate(without.source, origin="saved", special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert saved.render(messages).text == text.removeprefix("<s>")


@pytest.mark.parametrize("name", ["spillway", "chatml"])
def test_every_builtin_template_starts_with_the_bos_a_tokenizer_puts_before_its_documents(name):
    """A new user's finding: chatml never wrote it, so a Gemma or Llama 3 base (whose documents start with a
    BOS) was fine-tuned, and its export prompted by transformers, without the BOS it was pretrained with."""
    special = {"bos_token": "<bos>", "eos_token": "<eos>"}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with_bos = resolve_chat_template(name, None, special, bos_first=True).render(messages).text
    without = resolve_chat_template(name, None, special).render(messages).text
    assert with_bos == "<bos>" + without and not without.startswith("<bos>")


def test_builtin_template_marks_the_assistant_only_where_it_speaks_next():
    # Two user turns in a row (ShareGPT data has them): no empty "### Assistant:" between them, which would show
    # the model an assistant that said nothing; a conversation ending with a user turn ends with the marker,
    # as a prompt for generation needs.
    chat = resolve_chat_template("spillway", None, {"eos_token": "</s>"})
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
    assert chat.render(messages).text == ("### User:\na\n\n### User:\nb\n\n### Assistant:\nc</s>\n\n"
                                          "### User:\nd\n\n### Assistant:\n")


def test_a_role_the_template_does_not_know_is_named():
    tokenizer = _SentencePieceLike()
    chat = resolve_chat_template("spillway", None, {"eos_token": "</s>"})
    with pytest.raises(DataError, match="role 'narrator' is not one the chat template built-in spillway knows"):
        conversation_tokens(chat, tokenizer, [{"role": "narrator", "content": "once"}], {}, "f.jsonl, line 3")
    # what to do: a role in other case is written in the template's; another role needs another template
    with pytest.raises(DataError, match="role 'User' is not one .*: write it 'user'$"):
        conversation_tokens(chat, tokenizer, [{"role": "User", "content": "hi"}], {}, "f.jsonl, line 4")
    with pytest.raises(DataError, match="role 'tool' is not one .*: give data.chat_template a template that knows"):
        conversation_tokens(chat, tokenizer, [{"role": "tool", "content": "42"}], {}, "f.jsonl, line 5")


def test_a_role_a_foreign_template_drops_is_named(tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}"
                                      "{% endfor %}")
    chat = resolve_chat_template(str(tmp_path / "t.jinja"), None)
    with pytest.raises(DataError, match="does not render role 'tool'"):
        conversation_tokens(chat, _SentencePieceLike(), [{"role": "user", "content": "a"},
                                                        {"role": "tool", "content": "b"}], {}, "r")


@pytest.mark.parametrize("template", [TOOLS_CHATML, TOOLS_CHATML_GENERATION], ids=["turn_by_turn", "generation_blocks"])
def test_a_tool_call_is_trained_and_the_tool_result_is_not(transformers, tmp_path, template):
    """The record's tools reach the template as `tools`, the message's tool_calls and tool_call_id as keys, as
    transformers passes them; the loss is on the call (OpenAI's null content) and the answer, not the result."""
    reference = saved_tokenizer(transformers, tmp_path, template)
    tokenizer = load_tokenizer(tmp_path)
    chat = resolve_chat_template(None, tmp_path)
    ids, flags = conversation_tokens(chat, tokenizer, TOOL_CONVERSATION, special_token_texts(tokenizer), "t",
                                     tools=TOOLS)
    generation = template is TOOLS_CHATML_GENERATION
    expected = reference.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=generation)
    assert ids.tolist() == list(expected["input_ids"])
    assert "Tools: get_weather<|im_end|>" in reference.decode(ids) and " #c1<|im_end|>" in reference.decode(ids)
    if generation:
        assert flags.astype(int).tolist() == list(expected["assistant_masks"])
    targets = [int(i) for i, f in zip(ids, flags) if f]
    answers = '<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>It is sunny.<|im_end|>'
    assert reference.decode(targets) == answers
    call, answer = answers.split("<|im_end|>")[:2]
    assert targets == [*reference.encode(call + "<|im_end|>", add_special_tokens=False),
                       *reference.encode(answer + "<|im_end|>", add_special_tokens=False)]


@pytest.mark.parametrize("content, says", [
    ("", r"the chat template .*t.jinja does not write the assistant's tool call 'get_weather' into its answer, "
         r"which would be trained without the call; use a chat template that renders \"tool_calls\""),
    (None, r"chat template .* failed to render: .*; a message has tool_calls and a null content: use a chat template that renders "
           r"\"tool_calls\"$"),
])
def test_a_template_that_does_not_render_tool_calls_is_refused_naming_the_record(tmp_path, content, says):
    """Rendered without its call the turn is empty: the model would learn to answer with nothing."""
    (tmp_path / "t.jinja").write_text(CHATML)
    chat = resolve_chat_template(str(tmp_path / "t.jinja"), None)
    messages = [dict(message) for message in TOOL_CONVERSATION]
    messages[1]["content"] = content
    with pytest.raises(DataError, match=r"^record calls.jsonl, line 4: " + says):
        conversation_tokens(chat, _SentencePieceLike(), messages, {"<|im_end|>": 3}, "calls.jsonl, line 4")


def test_a_template_that_ends_no_answer_with_an_end_of_turn_token_is_warned_of(tmp_path):
    """`{{ role }}: {{ content }}` trained answers with no EOS after them: a model that never stops, unsaid."""
    from spillway.data.sft_targets import answer_end_warning

    special = {"bos_token": "<s>", "eos_token": "</s>"}
    specials = {"<s>": 1, "</s>": 2}
    for name in ("spillway", "chatml"):
        assert answer_end_warning(resolve_chat_template(name, None, special, bos_first=True), specials) is None
    bare = tmp_path / "bare.jinja"
    bare.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    line = answer_end_warning(resolve_chat_template(str(bare), None, special), specials)
    assert line.startswith(f"warning: chat template {bare} writes no end-of-turn token after an answer")


def test_a_misspelled_variable_or_an_empty_template_is_not_called_an_unknown_role(tmp_path):
    from spillway.data.sft_targets import answer_spans

    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    misspelled = tmp_path / "t.jinja"
    misspelled.write_text("{% for m in messages %}{{ m.contnt }}</s>{% endfor %}")
    with pytest.raises(DataError, match=r"does not render role 'user' .*a misspelled variable"):
        answer_spans(resolve_chat_template(str(misspelled), None, {"eos_token": "</s>"}), messages, {"</s>": 2}, "f:1")
    empty = tmp_path / "e.jinja"
    empty.write_text("")
    with pytest.raises(DataError, match=r"does not render role 'user' .*: an empty template"):
        answer_spans(resolve_chat_template(str(empty), None, {"eos_token": "</s>"}), messages, {"</s>": 2}, "f:1")


def test_a_tool_calling_turn_whose_text_the_template_leaves_out_is_not_called_an_unknown_role(tmp_path):
    """A new user's finding: Llama 3.1's template writes an assistant turn that has tool_calls as its call alone, so
    a record with text beside the call ("Let me look that up.") was refused as a role the template does not know
    or a misspelled variable, though the template writes the turn: the line now says what the template does."""
    from spillway.data.sft_targets import answer_spans

    llama31 = tmp_path / "llama31.jinja"   # its rule for an assistant turn, as Llama-3.1-Instruct publishes it
    llama31.write_text("{% for m in messages %}{% if 'tool_calls' in m %}{{ '{\"name\": \"' + "
                       "m.tool_calls[0].function.name + '\"}' }}{% else %}{{ m.content }}{% endif %}</s>{% endfor %}")
    messages = [dict(message) for message in TOOL_CONVERSATION]
    messages[1]["content"] = "Let me look that up."
    with pytest.raises(DataError, match=r"^record f:1: the chat template .*llama31.jinja writes message 1's tool "
                                        r"call but not the text beside it .*; leave it out of the record's "
                                        r"tool-calling turns, or give data.chat_template a template that writes it$"):
        answer_spans(resolve_chat_template(str(llama31), None, {"eos_token": "</s>"}), messages, {"</s>": 2}, "f:1")


def test_a_message_the_template_writes_only_in_a_shorter_conversation_is_not_called_an_unknown_role(tmp_path):
    """A new user's finding: Mistral v0.3's template writes the system message into the last user turn alone, so a
    conversation ending with an answer renders without it. It was refused as a role the template does not know or
    a misspelled variable, though the template reads `system`: the line now says what the template does."""
    from spillway.data.sft_targets import answer_spans

    mistral = tmp_path / "mistral.jinja"   # its system-message placement, as Mistral-7B-Instruct-v0.3 publishes it
    mistral.write_text(
        "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set turns = messages[1:] %}"
        "{% else %}{% set turns = messages %}{% endif %}{{ bos_token }}{% for m in turns %}{% if m.role == 'user' %}"
        "{% if loop.last and system is defined %}{{ '[INST] ' + system + '\n\n' + m.content + '[/INST]' }}"
        "{% else %}{{ '[INST] ' + m.content + '[/INST]' }}{% endif %}{% else %}{{ ' ' + m.content + eos_token }}"
        "{% endif %}{% endfor %}")
    chat = resolve_chat_template(str(mistral), None, {"bos_token": "<s>", "eos_token": "</s>"})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=r"^record f:1: the chat template .*mistral.jinja leaves message 0 \(role "
                                        r"'system'\) out of this conversation, though it writes it in the "
                                        r"conversation's first 2 messages: .*put its text into a user message"):
        answer_spans(chat, messages, {"</s>": 2}, "f:1")
