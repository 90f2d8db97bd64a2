"""Templates that render an earlier turn differently once later ones follow, read from the whole rendering.

Qwen3's writes its `<think>` block (empty or not) into the answers after the last user message alone and leaves
out the reasoning of earlier ones; Mistral v0.3's writes the tools before the last user message. Their records
with a second user turn or an answered tool call were refused ("renders earlier turns differently once later
ones follow"); their answers are read from the whole conversation as rendered once: the tokens transformers'
`return_assistant_tokens_mask` marks with a copy of the template whose generation blocks hold what the model
writes in an assistant turn (its text through its end of turn), a weight-0 answer's left out. The templates are
the published ones; the tokenizers are built here with `tokenizers` (tokenizer.json and tokenizer_config.json, as
a checkpoint has them). The span tests need no transformers.
"""

import json
import random

import pytest

from spillway.data import load_tokenizer
from spillway.data.chat_template import ChatTemplate, ChatTemplateError, resolve_chat_template
from spillway.data.sft_targets import _turn_by_turn_spans, answer_spans, conversation_tokens, special_token_texts

# Qwen3's chat template, as the Qwen3 checkpoints publish it in tokenizer_config.json.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Mistral-7B-Instruct-v0.3's chat template, as published (with its tools).
MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""


def _replaced(template: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert template.count(old) == 1, old
        template = template.replace(old, new)
    return template


# The copies with generation blocks around what the model writes in an assistant turn: Qwen3's from after
# "<|im_start|>assistant\n" through "<|im_end|>", Mistral's its answer or its tool calls with the EOS after them.
QWEN3_GENERATION = _replaced(
    QWEN3,
    ("""        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}""",
     """        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- content }}
            {%- endif %}
        {%- else %}
            {{- content }}
        {%- endif %}"""),
    ("""            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}""",
     """            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}"""))
MISTRAL_V03_GENERATION = _replaced(
    MISTRAL_V03,
    ("""        {{- "[TOOL_CALLS] [" }}""", """        {%- generation %}
        {{- "[TOOL_CALLS] [" }}"""),
    ("""                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}""", """                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
        {%- endgeneration %}"""),
    ("""        {{- " " + message["content"]|trim + eos_token}}""",
     """        {%- generation %}{{- " " + message["content"]|trim + eos_token}}{%- endgeneration %}"""))

QWEN3_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
MISTRAL_SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5,
                    "[AVAILABLE_TOOLS]": 6, "[/AVAILABLE_TOOLS]": 7, "[TOOL_RESULTS]": 8, "[/TOOL_RESULTS]": 9}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def _user(text):
    return {"role": "user", "content": text}


def _call(call_id="call12345", city="Paris", content=None, **more):
    return {"role": "assistant", "content": content, **more, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]}


def _result(text, call_id="call12345"):
    return {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": text}


def _answer(text, **more):
    return {"role": "assistant", "content": text, **more}


def _targets(template: str, specials: dict, messages: list[dict], tools=None) -> list[str]:
    text, spans = answer_spans(ChatTemplate(template, origin="t", special_tokens={"bos_token": "<s>",
                                                                                 "eos_token": "</s>"}),
                               messages, specials, "r", tools)
    return [text[start:end] for start, end in spans]


def test_qwen3s_multi_turn_answers_are_read_from_the_whole_rendering():
    """Before: 'renders earlier turns differently once later ones follow' for this record. Each answer runs from
    after "<|im_start|>assistant\\n" through its <|im_end|>: the earlier ones without the reasoning the template
    leaves out (given as reasoning_content or inline), the ones after the last user message with their <think>
    block, a tool call from its <think> block through its end of turn; a weight-0 answer is left out."""
    messages = [SYSTEM, _user("hello"), _answer("forty two", reasoning_content="the answer is"),
                _user("and again"), _answer("<think>\nsay it\n</think>\n\nforty three"),
                _user("once more"), _answer("wrong", weight=0), _user("weather in Paris?"),
                _call(reasoning_content="look it up"), _result("sunny"),
                _answer("It is sunny.", reasoning_content="it said sunny")]
    assert _targets(QWEN3, QWEN3_SPECIALS, messages, TOOLS) == [
        "forty two<|im_end|>", "forty three<|im_end|>",
        '<think>\nlook it up\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><|im_end|>',
        "<think>\nit said sunny\n</think>\n\nIt is sunny.<|im_end|>"]
    # the copy with generation blocks marks the same (its weight-0 answer found in the whole rendering too)
    assert _targets(QWEN3_GENERATION, QWEN3_SPECIALS, messages, TOOLS) == \
        _targets(QWEN3, QWEN3_SPECIALS, messages, TOOLS)


def test_qwen3s_empty_answers_and_answers_said_in_their_reasoning_train_whole():
    """One answer, read turn by turn: an empty one trained nothing (its content, empty, was followed by the
    template's <think> block, not by its end of turn), and one whose reasoning says its text first stopped
    there; both now train what a generation-block copy marks. In the whole rendering too."""
    assert _targets(QWEN3, QWEN3_SPECIALS, [_user("hi"), _answer("")]) == ["<think>\n\n</think>\n\n<|im_end|>"]
    said = _answer("42", reasoning_content="six times seven is 42")
    assert _targets(QWEN3, QWEN3_SPECIALS, [_user("hi"), said]) == \
        ["<think>\nsix times seven is 42\n</think>\n\n42<|im_end|>"]
    assert _targets(QWEN3, QWEN3_SPECIALS, [_user("hi"), _answer(""), _user("again"), said]) == \
        ["<|im_end|>", "<think>\nsix times seven is 42\n</think>\n\n42<|im_end|>"]


def test_a_prompt_that_opens_the_reasoning_starts_the_answers_after_what_the_turn_writes_of_it():
    """Qwen3-Thinking's generation prompt ends with "<think>\\n": an answer after the last user message starts
    after it (as turn by turn: the prompt is not the model's to write); an earlier one, its reasoning left out,
    after the "<|im_start|>assistant\\n" it does write. Before: the multi-turn record was refused."""
    thinking = _replaced(QWEN3, ("""    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking""", """    {{- '<|im_start|>assistant\\n<think>\\n' }}
    {%- if enable_thinking"""))
    messages = [_user("hi"), _answer("one", reasoning_content="r1"), _user("again"),
                _answer("two", reasoning_content="r2")]
    assert _targets(thinking, QWEN3_SPECIALS, messages[:2]) == ["r1\n</think>\n\none<|im_end|>"]
    assert _targets(thinking, QWEN3_SPECIALS, messages) == ["one<|im_end|>", "r2\n</think>\n\ntwo<|im_end|>"]


def test_an_empty_answer_the_template_leaves_out_trains_nothing():
    """Before: 'writes the conversation before assistant message 1 otherwise than its generation prompt does'
    (the prompt opens a turn the conversation does not write); read from the whole rendering, it has no text to
    train and the answers after it train as written."""
    leaves_out = _replaced(QWEN3, ("""    {%- elif message.role == "assistant" %}""",
                                   """    {%- elif message.role == "assistant" and (content or message.tool_calls) %}"""))
    messages = [_user("hi"), _answer(""), _user("again"), _answer("two")]
    assert _targets(leaves_out, QWEN3_SPECIALS, messages) == ["<think>\n\n</think>\n\ntwo<|im_end|>"]


def test_mistral_v03s_tool_records_are_read_from_the_whole_rendering():
    """Its tools are written before the last user message: a record with an answer before it was refused. Each
    answer is its " " text and </s>, a tool call its [TOOL_CALLS] list and </s>, as its generation-block copy
    marks them; a weight-0 answer is left out."""
    messages = [_user("hello"), _answer("forty two"), _user("and again"), _answer("wrong", weight=0),
                _user("weather in Paris?"), _call(), _result("sunny"), _answer("It is sunny.")]
    expected = [" forty two</s>", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
                                  '"id": "call12345"}]</s>', " It is sunny.</s>"]
    assert _targets(MISTRAL_V03, MISTRAL_SPECIALS, messages, TOOLS) == expected
    assert _targets(MISTRAL_V03_GENERATION, MISTRAL_SPECIALS, messages, TOOLS) == expected


def test_an_answer_ended_otherwise_before_later_turns_is_refused_naming_the_record():
    """A template that ends the last answer with another token than earlier ones (gpt-oss' <|return|>, <|end|>)
    cannot be read from the whole rendering as a conversation ending with the answer writes it: refused, with the
    generation-block way out."""
    template = ("{% for m in messages %}{{ '<|start|>' + m.role + '<|message|>' + m.content }}"
                "{{ '<|return|>' if loop.last and m.role == 'assistant' else '<|end|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|start|>assistant<|message|>' }}{% endif %}")
    specials = {"<|start|>": 0, "<|message|>": 1, "<|end|>": 2, "<|return|>": 3}
    assert _targets(template, specials, [_user("hi"), _answer("hello")]) == ["hello<|return|>"]
    with pytest.raises(ChatTemplateError, match=r"writes assistant message 1 otherwise in the whole conversation "
                                                r"than in one that ends with it, so the end of its answer cannot be "
                                                r"found \(record r\); use a template with \{% generation %\} blocks"):
        _targets(template, specials, [_user("hi"), _answer("hello"), _user("again"), _answer("bye")])


def _qwen3_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.add_special_tokens(list(QWEN3_SPECIALS))
    # its markup tokens are added tokens, not special ones (Qwen3's tokenizer.json has them so)
    markup = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in markup])
    return tokenizer, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def _mistral_tokenizer():
    """Laid out as Mistral v0.3's tokenizer.json: a BPE on "▁"-marked words, byte fallback, the control tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, special_tokens=list(MISTRAL_SPECIALS))
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


_CORPUS = ["hello world how are you today the answer is forty two", "weather in Paris sunny warm London",
           "get_weather city arguments name function You are a helpful assistant look it up"] * 20
_WORDS = "hello world how are you today the answer is forty two sunny Paris".split()


def _folder(directory, built, template):
    tokenizer, special = built
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {**special, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
    return directory


def _words(draw):
    return " ".join(draw.choice(_WORDS) for _ in range(draw.randint(1, 6)))


def _drawn_answer(draw, qwen3, **more):
    kind = draw.choice(["plain", "reasoning", "inline", "empty"] if qwen3 else ["plain"])
    content = {"plain": _words(draw), "empty": "", "reasoning": _words(draw),
               "inline": f"<think>\n{_words(draw)}\n</think>\n\n{_words(draw)}"}[kind]
    if kind == "reasoning":
        more["reasoning_content"] = _words(draw)
    if "tool_calls" in more and not qwen3:
        content = None   # (Mistral's template writes a tool call's content nowhere)
    weight = {"weight": 0} if draw.random() < 0.2 else {}
    return {"role": "assistant", "content": content, **more, **weight}


def _drawn_conversation(draw, qwen3):
    """User turns, each answered, some through tool calls (Qwen3: parallel ones) and their results."""
    tools = TOOLS if draw.random() < 0.6 else None
    messages = [SYSTEM] if qwen3 and draw.random() < 0.4 else []
    for turn in range(draw.randint(1, 4)):
        messages.append(_user(_words(draw)))
        for step in range(draw.randint(0, 2) if tools else 0):
            ids = [f"call{turn}{step}{k}abc"[:9] for k in range(draw.randint(1, 2) if qwen3 else 1)]
            calls = [_call(call_id, draw.choice(["Paris", "London"]))["tool_calls"][0] for call_id in ids]
            messages.append(_drawn_answer(draw, qwen3, tool_calls=calls))
            messages.extend(_result(_words(draw), call_id) for call_id in ids)
        messages.append(_drawn_answer(draw, qwen3))
    return messages, tools


def _reference_targets(reference, messages, tools):
    """transformers' ids and assistant mask on the generation-block copy, the runs of weight-0 answers cleared
    (each assistant message is one run: its block ends with its end of turn, a newline before the next)."""
    expected = reference.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    mask = list(expected["assistant_masks"])
    runs = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
    answers = [message for message in messages if message["role"] == "assistant"]
    assert len(runs) == len(answers)
    for start, message in zip(runs, answers):
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        if message.get("weight", 1) == 0:
            mask[start:end] = [0] * (end - start)
    return list(expected["input_ids"]), mask


@pytest.mark.parametrize("family", ["qwen3", "mistral_v03"])
def test_targets_equal_transformers_assistant_mask_on_a_generation_block_copy(tmp_path, family):
    """Drawn records (multi-turn, reasoning as reasoning_content or inline, tool calls and results, weight-0
    answers, system prompts): the ids and targets of the published template equal transformers' on its copy with
    generation blocks, as do those of the copy itself; most of them are read from the whole rendering."""
    transformers = pytest.importorskip("transformers")
    qwen3 = family == "qwen3"
    built = _qwen3_tokenizer() if qwen3 else _mistral_tokenizer()
    plain = _folder(tmp_path / "plain", built, QWEN3 if qwen3 else MISTRAL_V03)
    copy = _folder(tmp_path / "generation", built, QWEN3_GENERATION if qwen3 else MISTRAL_V03_GENERATION)
    reference = transformers.AutoTokenizer.from_pretrained(copy)
    tokenizer = load_tokenizer(plain)
    specials = special_token_texts(tokenizer)
    draw, whole = random.Random(0), 0
    for record in range(40):
        messages, tools = _drawn_conversation(draw, qwen3)
        expected = _reference_targets(reference, messages, tools)
        for folder in (plain, copy):
            ids, flags = conversation_tokens(resolve_chat_template(None, folder), tokenizer, messages, specials,
                                             f"r{record}", tools=tools)
            assert (ids.tolist(), flags.astype(int).tolist()) == expected, (record, folder.name, messages)
        template = resolve_chat_template(None, plain)
        whole += _turn_by_turn_spans(template, messages, template.render(messages, tools=tools).text, specials,
                                     "r", tools) is None
    assert whole >= 15   # (the drawn records take the whole-rendering reading, not only the turn-by-turn one)
