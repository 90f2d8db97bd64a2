"""Chat templates as real checkpoints ship them, against transformers' `apply_chat_template`.

A tokenizer with named templates (a "tool_use" one beside the default, saved as
transformers 5 saves them or in an older tokenizer_config.json list) renders a
conversation given tools with the tool_use one; a run's tokenizer copy and its
export keep them. A message's reasoning under a dataset's name for it reaches a
template reading `reasoning_content`. A template that rewrites the assistant's
content (DeepSeek-R1's drops the reasoning before "</think>") trains the answer
it writes. A template error that has nothing to do with a null tool-call content
is not given that hint. Qwen3's, which writes an answer otherwise once a user turn
follows it, trains its multi-turn records as its copy with generation blocks does
(tests/data/test_chat_template_whole.py holds the published templates).
"""

import json

import pytest

from spillway.data import load_tokenizer
from spillway.data.chat_template import ChatTemplateError, resolve_chat_template
from spillway.data.chat_template_files import CHAT_TEMPLATE_DIR, tokenizer_templates, write_templates
from spillway.data.sft_targets import conversation_tokens, special_token_texts
from spillway.layers.errors import DataError
from tests.data.test_chat_template import CHATML, TOOL_CONVERSATION, TOOLS, TOOLS_CHATML, saved_tokenizer

NAMED = {"default": CHATML, "tool_use": TOOLS_CHATML}
ASKED = [{"role": "user", "content": "weather in Paris?"}, {"role": "assistant", "content": "It is sunny."}]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _ids(directory, messages, tools=None):
    tokenizer = load_tokenizer(directory)
    chat = resolve_chat_template(None, directory)
    ids, flags = conversation_tokens(chat, tokenizer, messages, special_token_texts(tokenizer), "r", tools=tools)
    return ids.tolist(), flags


def _config_list_folder(transformers, directory):
    """The older form: both templates in tokenizer_config.json's list, no .jinja files."""
    saved_tokenizer(transformers, directory, CHATML)
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": name, "template": text} for name, text in NAMED.items()]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("form", ["jinja_files", "config_list"])
def test_a_conversation_given_tools_renders_with_the_tool_use_template(transformers, tmp_path, form):
    if form == "jinja_files":
        reference = saved_tokenizer(transformers, tmp_path, NAMED)
        assert (tmp_path / CHAT_TEMPLATE_DIR / "tool_use.jinja").is_file()   # transformers 5's layout
    else:
        reference = _config_list_folder(transformers, tmp_path)
    for messages, tools in ((ASKED, TOOLS), (TOOL_CONVERSATION, TOOLS), (ASKED, None)):
        expected = reference.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
        assert _ids(tmp_path, messages, tools)[0] == list(expected["input_ids"])
    assert "Tools: get_weather" in reference.decode(_ids(tmp_path, ASKED, TOOLS)[0])


def test_a_run_copy_and_its_templates_load_in_transformers_as_the_source(transformers, tmp_path):
    """save_to_directory keeps the named files; write_templates writes them where transformers reads them and
    drops a copied one the run does not render with."""
    saved_tokenizer(transformers, tmp_path / "source", NAMED)
    run = tmp_path / "run"
    load_tokenizer(tmp_path / "source").save_to_directory(run)
    chat = resolve_chat_template(None, tmp_path / "source")
    write_templates(run, chat.all_named, chat.special_tokens)
    copy = transformers.AutoTokenizer.from_pretrained(run)
    assert copy.chat_template == NAMED
    expected = copy.apply_chat_template(ASKED, tools=TOOLS, tokenize=True, return_dict=True)
    assert _ids(run, ASKED, TOOLS)[0] == list(expected["input_ids"])
    write_templates(run, {"default": CHATML})   # a run rendering with one template: no tool_use left behind
    assert not (run / CHAT_TEMPLATE_DIR / "tool_use.jinja").exists()
    assert tokenizer_templates(run)[0] == {"default": CHATML}
    assert transformers.AutoTokenizer.from_pretrained(run).chat_template == CHATML


def test_an_export_copies_the_named_template_files_and_refuses_a_stranger(transformers, tmp_path):
    from spillway.recipes.export import _check_out_dir, _copy_tokenizer, _tokenizer_files

    saved_tokenizer(transformers, tmp_path / "run", NAMED)
    (tmp_path / "out").mkdir()
    copied = _copy_tokenizer(tmp_path / "run", tmp_path / "out")
    assert f"{CHAT_TEMPLATE_DIR}/tool_use.jinja" in copied
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == NAMED
    # another checkpoint's named template in the folder would be read beside the export's default
    (tmp_path / "run" / CHAT_TEMPLATE_DIR / "tool_use.jinja").unlink()
    with pytest.raises(Exception, match=r"already holds another checkpoint .*tool_use.jinja"):
        _check_out_dir(tmp_path / "out", "model.safetensors", _tokenizer_files(tmp_path / "run"))


def test_the_tool_use_templates_end_of_turn_ends_an_answer_too(transformers, tmp_path):
    """A tool_use template ending its turns with another special token trained that token as the end of its
    answers, but generation stopped at the default's only."""
    from spillway.data.sft_targets import end_of_turn_ids

    reads_its_tools = "{{ tools[0].function.name }}"   # a template that cannot render without tools
    saved_tokenizer(transformers, tmp_path, {"default": CHATML, "tool_use": reads_its_tools + TOOLS_CHATML.replace(
        "<|im_end|>", "<|endoftext|>")})
    tokenizer = load_tokenizer(tmp_path)
    specials = special_token_texts(tokenizer)
    ids = end_of_turn_ids(resolve_chat_template(None, tmp_path), tokenizer, specials)
    assert {specials["<|im_end|>"], specials["<|endoftext|>"]} <= set(ids)


def test_named_templates_without_a_default_or_with_a_path_for_a_name_are_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": TOOLS_CHATML}, {"name": "rag", "template": CHATML}]}))
    with pytest.raises(ChatTemplateError, match=r"the chat templates of .*tokenizer_config.json are named rag, "
                                                 r"tool_use, none 'default': name the one to train with"):
        resolve_chat_template(None, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": CHATML}, {"name": "../../evil", "template": CHATML}]}))
    with pytest.raises(ChatTemplateError, match=r"chat template name '../../evil' is not a plain file name"):
        resolve_chat_template(None, tmp_path)


REASONING_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}{% if m.role == 'assistant' and m.reasoning_content %}"
    "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}{{ m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("field", ["reasoning", "thinking", "reasoning_content"])
def test_a_messages_reasoning_under_any_of_its_names_is_rendered(transformers, tmp_path, field):
    reference = saved_tokenizer(transformers, tmp_path, REASONING_CHATML)
    messages = [{"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "forty two", field: "the answer is"}]
    ids, flags = _ids(tmp_path, messages)
    assert ids == list(reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert reference.decode([i for i, f in zip(ids, flags) if f]) == \
        "<think>the answer is</think>forty two<|im_end|>"


R1_LIKE = ("{% for m in messages %}{% set content = m.content %}"
           "{% if m.role == 'assistant' and '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
           "{% endif %}{{ '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# DeepSeek-R1's later template: its generation prompt opens the answer with "<think>\n", which the conversation
# (the answer after "</think>") does not write
R1_THINK_PROMPT = R1_LIKE.replace("{{ '<|im_start|>assistant\n' }}{% endif %}",
                                  "{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")


@pytest.mark.parametrize("template", [R1_LIKE, R1_THINK_PROMPT], ids=["r1", "r1_think_prompt"])
def test_a_template_that_rewrites_the_answer_trains_what_it_writes(transformers, tmp_path, template):
    """Said before: 'does not render role assistant (its message is missing from the text)', and for the
    later template 'renders earlier turns differently once later ones follow'."""
    assert ("<think>" in template) == (template is R1_THINK_PROMPT)   # the replace took
    reference = saved_tokenizer(transformers, tmp_path, template)
    messages = [{"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "<think>\nthe answer is\n</think>\n\nforty two"},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "hello today"}]
    ids, flags = _ids(tmp_path, messages)
    assert ids == list(reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert reference.decode([i for i, f in zip(ids, flags) if f]) == \
        "\n\nforty two<|im_end|>hello today<|im_end|>"


_GENERATION_PROMPT = "{{ '<|im_start|>assistant\n' }}{% endif %}"
SYSTEM_LINE_PROMPT = CHATML.replace(_GENERATION_PROMPT, "{{ '<|im_start|>system\nbe brief<|im_end|>\n"
                                                        "<|im_start|>assistant\n' }}{% endif %}")
PREFILLED_PROMPT = CHATML.replace(_GENERATION_PROMPT, "{{ '<|im_start|>assistant\nthe ' }}{% endif %}")


@pytest.mark.parametrize("template, answer, trained", [
    (SYSTEM_LINE_PROMPT, "forty two", "forty two"),           # the role header was trained ('assistant\nforty two')
    (R1_THINK_PROMPT, "<think>forty two", "<think>forty two"),  # the answer's '<t' was not (the prompt's '<think>')
    # a prompt the conversation continues: the answer is what generation writes after it (TRL's split)
    (PREFILLED_PROMPT, "the answer is", " answer is"),
], ids=["system_line", "r1_answer_opening_like_the_prompt", "prefilled"])
def test_an_answer_starts_where_the_conversation_opens_the_turn_whatever_the_prompt_adds(
        transformers, tmp_path, template, answer, trained):
    assert template != CHATML   # the replace took
    reference = saved_tokenizer(transformers, tmp_path, template)
    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "hello today"}]
    ids, flags = _ids(tmp_path, messages)
    assert ids == list(reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert reference.decode([i for i, f in zip(ids, flags) if f]) == f"{trained}<|im_end|>hello today<|im_end|>"


def test_a_missing_role_is_still_named_when_contents_are_rewritten(tmp_path):
    """The probe that lets a rewritten content through still finds a role the template leaves out."""
    drops_tool = tmp_path / "t.jinja"
    drops_tool.write_text("{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}<|im_end|>{% endif %}"
                          "{% endfor %}")
    messages = [{"role": "user", "content": "hello"}, {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "today"}]
    with pytest.raises(DataError, match=r"does not render role 'tool'"):
        conversation_tokens(resolve_chat_template(str(drops_tool), None), None, messages, {"<|im_end|>": 2}, "r")


def test_the_null_content_hint_is_given_only_for_a_none_error(tmp_path):
    """A template refusing the tool role said 'a message has tool_calls and a null content' as well."""
    alternating = tmp_path / "t.jinja"
    alternating.write_text("{% for m in messages %}{% if m.role not in ('user', 'assistant') %}"
                           "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                           "{{ m.content or '' }}<|im_end|>{% endfor %}")
    chat = resolve_chat_template(str(alternating), None)
    with pytest.raises(ChatTemplateError, match=r"roles must alternate user/assistant$"):
        conversation_tokens(chat, None, TOOL_CONVERSATION, {"<|im_end|>": 2}, "r")
    strips = tmp_path / "s.jinja"   # the sandbox's own words for a null content: "'None' has no attribute"
    strips.write_text("{% for m in messages %}{{ m.content.strip() }}<|im_end|>{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"has no attribute 'strip'; a message has tool_calls and a null"):
        conversation_tokens(resolve_chat_template(str(strips), None), None, TOOL_CONVERSATION, {"<|im_end|>": 2}, "r")


def test_a_copied_named_default_does_not_outlive_the_runs_own(transformers, tmp_path):
    """additional_chat_templates/default.jinja wins over chat_template.jinja in transformers' reading: one copied
    from a base was exported as the run's template although the run trained with another."""
    saved_tokenizer(transformers, tmp_path, NAMED)
    (tmp_path / CHAT_TEMPLATE_DIR / "default.jinja").write_text("DD")
    assert tokenizer_templates(tmp_path)[0]["default"] == "DD"   # as transformers reads it
    write_templates(tmp_path, {"default": CHATML})
    assert not (tmp_path / CHAT_TEMPLATE_DIR / "default.jinja").exists()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).chat_template == CHATML


def test_named_templates_key_the_rows_and_a_runs_record_of_them_keeps_old_runs_resumable(tmp_path):
    from spillway.data.sft_packing import SftOptions, prepare_sft_rows
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.corpus_record import _template_file, corpus_differences
    from tests.data.test_sft_resume import CharTokenizer

    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": ASKED, "tools": TOOLS}) + "\n" for _ in range(8)))
    config = tmp_path / "tokenizer_config.json"

    def prepared(tool_use: str):
        config.write_text(json.dumps({"chat_template": [{"name": "default", "template": CHATML},
                                                        {"name": "tool_use", "template": tool_use}]}))
        template = resolve_chat_template(str(config), None, {"eos_token": "<|im_end|>"})
        rows = prepare_sft_rows(str(source), CharTokenizer(), template, SftOptions("chat", 256, val_fraction=0),
                                cache_dir=tmp_path / "cache")
        return rows, _template_file(get_recipe("tiny", ["data.format=chat", f"data.chat_template={config}"]))

    (rows, record), (edited_rows, edited) = prepared(TOOLS_CHATML), prepared(TOOLS_CHATML.replace("Tools:", "T:"))
    assert rows.path != edited_rows.path   # the rows of the other tool_use template were reused
    assert record["sha256"] == edited["sha256"]
    assert corpus_differences({"chat_template": record}, {"chat_template": edited}) == [
        f"data.chat_template {str(config)!r}: its named templates (beside the default) were edited"]
    # a run started before named templates were read rendered records with tools with the default: its rows
    # would change mid-run (the rows' count alone guarded it); one without a tool_use template is unchanged
    before_named = {key: value for key, value in record.items() if key not in ("named_sha256", "named")}
    said = corpus_differences({"chat_template": before_named}, {"chat_template": record})
    assert len(said) == 1 and "holds a tool_use template, which this run (started before" in said[0]
    assert corpus_differences({"chat_template": before_named}, {"chat_template": {**record, "named": ["rag"]}}) == []



# Qwen3's rule, as its published template has it: an answer after the last user message is written with its
# <think> block (empty when it has no reasoning) where it is the last message or has reasoning; earlier answers
# without it. `{GEN}`/`{END}`: where a copy puts its generation block.
_QWEN3_LIKE = (
    "{% set ns = namespace(last_query=messages|length - 1, found=false) %}"
    "{% for m in messages[::-1] %}{% if not ns.found and m.role == 'user' %}{% set ns.found = true %}"
    "{% set ns.last_query = messages|length - 1 - loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}{% if m.role == 'assistant' %}{GEN}"
    "{% if loop.index0 > ns.last_query and (loop.last or m.reasoning_content) %}"
    "{{ '<think>\n' + (m.reasoning_content or '') + '\n</think>\n\n' }}{% endif %}{{ m.content + '<|im_end|>' }}"
    "{END}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN3_LIKE = _QWEN3_LIKE.replace("{GEN}", "").replace("{END}", "")
QWEN3_LIKE_GENERATION = _QWEN3_LIKE.replace("{GEN}", "{% generation %}").replace("{END}", "{% endgeneration %}")


def test_qwen3s_earlier_turns_are_trained_as_rendered_with_or_without_generation_blocks(transformers, tmp_path):
    """Qwen3's template writes an answer otherwise once a user turn follows it, so its multi-turn records were
    refused turn by turn ('renders earlier turns differently once later ones follow ... use a template with
    {% generation %} blocks'); they are read from the whole rendering: the tokens transformers' assistant mask
    marks on its copy with generation blocks (the earlier answer's reasoning left out, as the template does),
    which trains the same."""
    messages = [{"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "forty two", "reasoning_content": "the answer is"},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "hello today"}]
    reference = saved_tokenizer(transformers, tmp_path / "generation", QWEN3_LIKE_GENERATION)
    expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    saved_tokenizer(transformers, tmp_path / "plain", QWEN3_LIKE)
    for folder in ("plain", "generation"):
        ids, flags = _ids(tmp_path / folder, messages)
        assert ids == list(expected["input_ids"]) and flags.astype(int).tolist() == list(expected["assistant_masks"])
        assert reference.decode([i for i, f in zip(ids, flags) if f]) == \
            "forty two<|im_end|><think>\n\n</think>\n\nhello today<|im_end|>"
    ids, flags = _ids(tmp_path / "plain", messages[:2])   # one answer: read turn by turn, as before
    assert reference.decode([i for i, f in zip(ids, flags) if f]) == \
        "<think>\nthe answer is\n</think>\n\nforty two<|im_end|>"
