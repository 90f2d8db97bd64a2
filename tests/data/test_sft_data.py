"""Fine-tuning records and rows: chat / ShareGPT / instruct records (their tool calls, tools, system prompts and
history as transformers and LLaMA-Factory take them), whole examples packed or padded, long ones truncated or
dropped and counted, examples without an answer skipped and counted, data.max_tokens, Parquet read through
`datasets`, and the shipped instruction set."""

import json
from dataclasses import replace

import numpy as np
import pytest

from spillway.data.chat_template import resolve_chat_template
from spillway.data.instruct_tiny import INSTRUCT_TINY, records
from spillway.data.sft_formats import Record, chat_messages, conversation_of, instruct_messages, iter_records
from spillway.data.sft_packing import SEGMENTS, TARGETS, TOKENS, SftOptions, prepare_sft_rows, row_layout
from spillway.layers.errors import DataError


class CharTokenizer:
    """One id per character, BOS 1 and EOS 2 (a sentencepiece-like tokenizer: no added tokens)."""

    bos_id, eos_id, vocab_size, fingerprint = 1, 2, 300, "chars"

    def token_text(self, token_id):
        return {1: "<s>", 2: "</s>"}[token_id]

    def encode(self, texts):
        return [[10 + ord(c) % 250 for c in text] for text in texts]

    def encode_with_offsets(self, text, starts_the_text=True):
        return self.encode([text])[0], [(k, k + 1) for k in range(len(text))]


def test_chat_sharegpt_and_instruct_records_become_conversations():
    chat = chat_messages(Record({"messages": [{"role": "user", "content": "hi"}]}, "f, line 1"))
    assert chat == [{"role": "user", "content": "hi"}]
    sharegpt = chat_messages(Record({"conversations": [{"from": "human", "value": "hi"},
                                                       {"from": "gpt", "value": "yo"}]}, "f, line 1"))
    assert sharegpt == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with_input = instruct_messages(Record({"instruction": "Sum", "input": "1 2", "output": "3"}, "w"))
    assert with_input == [{"role": "user", "content": "Sum\n\n1 2"}, {"role": "assistant", "content": "3"}]
    assert instruct_messages(Record({"instruction": "Sum", "input": "", "output": "3"}, "w"))[0]["content"] == "Sum"
    with pytest.raises(DataError, match=r"record f, line 4, message 0: needs string \"role\" and \"content\""):
        chat_messages(Record({"messages": [{"role": "user"}]}, "f, line 4"))


def test_rows_hold_whole_examples_packed_or_one_a_row():
    assert row_layout([3, 4, 2, 5], 8, "pack") == [[0, 1], [2, 3]]
    assert row_layout([3, 4, 2, 5], 8, "pad") == [[0], [1], [2], [3]]


def write_instruct(path, outputs):
    path.write_text("".join(json.dumps({"instruction": "q", "output": out}) + "\n" for out in outputs))
    return path


@pytest.mark.parametrize("overlong, kept", [("truncate", 6), ("drop", 4)])
def test_long_examples_are_truncated_or_dropped_and_counted(tmp_path, overlong, kept):
    source = write_instruct(tmp_path / "d.jsonl", ["ab", "cd", "x" * 80, "ef", "gh", "y" * 90])
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    packed = prepare_sft_rows(str(source), CharTokenizer(), template,
                              SftOptions("instruct", seq_len=40, overlong=overlong, val_fraction=0.0),
                              cache_dir=tmp_path / "cache")
    assert packed.overlong_examples == 2 and packed.overlong_policy == overlong
    # the answer tokens the cut took, counted: with rows long enough for all, none is cut and the sum is the same
    whole = prepare_sft_rows(str(source), CharTokenizer(), template,
                             SftOptions("instruct", seq_len=200, val_fraction=0.0), cache_dir=tmp_path / "cache")
    assert whole.overlong_examples == 0 and whole.cut_target_tokens == 0
    if overlong == "truncate":
        assert packed.cut_target_tokens > 0
        assert packed.target_tokens + packed.cut_target_tokens == whole.target_tokens
    else:
        assert packed.cut_target_tokens == 0
    rows = packed.train
    assert rows.shape[1:] == (3, 41)
    segments = rows[:, SEGMENTS]
    examples = sum(len(set(row[row > 0].tolist())) for row in segments)
    assert examples == kept
    for row in rows:   # every example starts with its BOS: none was split across rows
        starts = np.flatnonzero(np.diff(np.concatenate([[0], row[SEGMENTS]])) > 0)
        assert all(row[TOKENS][start] == 1 for start in starts)
    # targets: only answer tokens and the EOS after them, never the prompt
    assert (rows[:, TARGETS][rows[:, TOKENS] == 10 + ord("#") % 250] == 0).all()
    again = prepare_sft_rows(str(source), CharTokenizer(), template,
                             SftOptions("instruct", seq_len=40, overlong=overlong, val_fraction=0.0),
                             cache_dir=tmp_path / "cache")
    assert again.from_cache and np.array_equal(again.train, rows)


def test_parquet_records_are_read_file_by_file_whatever_their_other_columns(tmp_path):
    """Written by `datasets`, read as `datasets` reads them; a shard with a column the others lack (a new user's
    finding: refused, "holds records with fields ['messages', 'source']") is read all the same."""
    import datasets

    datasets.Dataset.from_list([{"instruction": "q", "output": "a"}]).to_parquet(str(tmp_path / "d.parquet"))
    [record] = list(iter_records(str(tmp_path / "d.parquet"), cache_dir=tmp_path / "cache"))
    assert record.fields == {"instruction": "q", "output": "a"} and record.where.endswith("d.parquet, row 1")
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    datasets.Dataset.from_list([{"messages": conversation}] * 2).to_parquet(str(tmp_path / "shards" / "a.parquet"))
    datasets.Dataset.from_list([{"messages": conversation, "source": "web"}]).to_parquet(
        str(tmp_path / "shards" / "b.parquet"))
    records = list(iter_records(str(tmp_path / "shards")))
    assert [r.fields["messages"] for r in records] == [conversation] * 3
    assert records[2].fields["source"] == "web" and records[2].where.endswith("b.parquet, row 1")


def test_the_shipped_instruction_set_is_what_its_generator_makes():
    shipped = [json.loads(line) for line in INSTRUCT_TINY.read_text().splitlines()]
    assert shipped == records() and len(shipped) == 280


@pytest.mark.parametrize("fields, message", [
    ({"instruction": "q", "output": None}, r'needs "output" .*; "output" is null\)'),
    ({"instruction": "q", "output": 3}, r'needs "output" .*; "output" is a number\)'),
    ({"instruction": ["q"], "output": "a"}, r'needs "instruction" .*; "instruction" is a list\)'),
])
def test_an_instruct_field_that_is_there_but_not_a_string_says_what_it_is(fields, message):
    """"fields found: instruction, output" beside 'needs "output"' would read as a contradiction."""
    with pytest.raises(DataError, match=message):
        instruct_messages(Record(fields, "f, line 6"))


@pytest.mark.parametrize("message, says", [
    ({"role": "assistant", "content": None}, r'\(fields found: content, role; "content" is null\)'),
    # an empty list of calls is no call: the null content's rule names it
    ({"role": "assistant", "content": None, "tool_calls": []},
     r'.*is read only beside a non-empty "tool_calls" .*; this message\'s "tool_calls" is empty: write "" for an '
     r'answer with no text$'),
    ("hello", r"\(it is a string, not an object\)"),
    # lists of parts are read: an empty one is not "a list" as if lists were refused
    ({"role": "assistant", "content": []}, r'\(fields found: content, role; "content" is a list.*\): an empty list '
                                           r'of parts; write "" for a message with no text$'),
])
def test_a_chat_message_that_is_not_role_and_content_strings_says_what_it_is(message, says):
    with pytest.raises(DataError, match=r"message 1: needs string \"role\" and \"content\" " + says):
        chat_messages(Record({"messages": [{"role": "user", "content": "hi"}, message]}, "f, line 2"))


def test_a_null_content_read_from_parquet_is_named_as_in_json_lines(tmp_path):
    """Reading Arrow leaves a struct's null fields out (`_as_written`), so a Parquet record's null content said
    "fields found: role", where the same record in JSON lines says which null is read where."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    pq.write_table(pa.Table.from_pylist([{"messages": conversation}]), tmp_path / "chat.parquet")
    [record] = iter_records(str(tmp_path / "chat.parquet"))
    with pytest.raises(DataError, match=r'message 1: needs string "role" and "content" \(fields found: content, '
                                        r'role; "content" is null\): a null "content" is read only beside a '
                                        r'non-empty "tool_calls"'):
        chat_messages(record)
    called = {**conversation[1], "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    pq.write_table(pa.Table.from_pylist([{"messages": [conversation[0], called]}]), tmp_path / "call.parquet")
    [record] = iter_records(str(tmp_path / "call.parquet"))
    assert chat_messages(record)[1] == {"role": "assistant", "content": None, "tool_calls": called["tool_calls"]}


@pytest.mark.parametrize("raw, says", [
    ('[{"role": "user", "content": "hi"}]', r'"messages" holds a string, not a list of turns \(a JSON '
                                            r'string of the list\? store the list itself\)'),
])
def test_a_conversation_that_is_not_a_list_says_what_the_field_holds(raw, says):
    with pytest.raises(DataError, match=r"record f, line 2: " + says):
        chat_messages(Record({"messages": raw}, "f, line 2"))


def test_a_source_with_no_answer_to_train_on_is_refused_not_trained_at_loss_zero(tmp_path):
    """Conversations without an assistant turn give rows whose loss covers no token: a run would log loss 0
    and save a model that learnt nothing."""
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                              for i in range(6)))
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    with pytest.raises(DataError, match=r"questions.jsonl': 6 examples and no token to train on: .*no example has "
                                        r"an assistant message.*data.train_on_prompt=true"):
        prepare_sft_rows(str(source), CharTokenizer(), template, SftOptions("chat", seq_len=40, val_fraction=0.0),
                         cache_dir=tmp_path / "cache")
    prompts = prepare_sft_rows(str(source), CharTokenizer(), template,
                               SftOptions("chat", seq_len=40, val_fraction=0.0, train_on_prompt=True),
                               cache_dir=tmp_path / "cache")
    assert prompts.target_tokens > 0


def test_cached_rows_with_no_answer_to_train_on_are_refused_too(tmp_path, monkeypatch):
    """Rows prepared before the check existed sit in the cache: reading them back is refused the same way."""
    from spillway.data import sft_packing

    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                              for i in range(6)))
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    options = SftOptions("chat", seq_len=40, val_fraction=0.0)
    take = sft_packing._take
    with monkeypatch.context() as patch:   # as an earlier version prepared them: unchecked, nothing skipped
        patch.setattr(sft_packing, "_check_targets", lambda *args, **kwargs: None)
        patch.setattr(sft_packing, "_take", lambda *args: take(*args[:-1], replace(args[-1], train_on_prompt=True)))
        assert prepare_sft_rows(str(source), CharTokenizer(), template, options,
                                cache_dir=tmp_path / "cache").target_tokens == 0
    with pytest.raises(DataError, match=r"6 examples and no token to train on"):
        prepare_sft_rows(str(source), CharTokenizer(), template, options, cache_dir=tmp_path / "cache")


def test_trl_prompt_completion_records_are_conversations_whose_completion_is_the_answer():
    """TRL's two forms: lists of messages (conversational), joined; strings (standard), one turn."""
    lists = chat_messages(Record({"prompt": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hi"}],
                                  "completion": [{"role": "assistant", "content": "yo"}]}, "f, line 1"))
    assert lists == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "yo"}]
    strings = chat_messages(Record({"prompt": "The sky is", "completion": " blue."}, "f, line 2"))
    assert strings == [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " blue."}]
    with pytest.raises(DataError, match=r'record f, line 3: "prompt" holds a string and "completion" a list; a '
                                        r'prompt-completion record holds two strings or two lists'):
        chat_messages(Record({"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}, "f, line 3"))


def test_a_record_of_the_other_format_says_which_format_it_is():
    with pytest.raises(DataError, match=r'has no "messages" .*; an instruction record\? set data.format=instruct$'):
        chat_messages(Record({"instruction": "q", "output": "a"}, "f, line 1"))
    with pytest.raises(DataError, match=r'needs "instruction", "output" .*\); a chat record\? set data.format=chat$'):
        instruct_messages(Record({"messages": [{"role": "user", "content": "hi"}]}, "f, line 1"))
    with pytest.raises(DataError, match=r'needs "instruction", "output" .*\); a chat record\? set data.format=chat$'):
        instruct_messages(Record({"prompt": "What is 2+2?", "completion": " 4"}, "f, line 1"))   # TRL's


def test_records_wrapped_in_a_data_object_are_named_with_the_list_that_holds_them():
    """{"data": [...]}: its one "record" is the wrapper, whose fields alone did not say where the records are."""
    said = r"; its records are in a list under 'data': .*store that list itself \(jq '\.data' FILE > NEW\.json\)$"
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    with pytest.raises(DataError, match=r'has no "messages" .*' + said):
        chat_messages(Record({"version": 1, "data": chat}, "f.json, line 1"))
    with pytest.raises(DataError, match=r'needs "instruction", "output" .*' + said):
        instruct_messages(Record({"data": [{"instruction": "q", "output": "a"}]}, "f.json, line 1"))
    with pytest.raises(DataError, match=r'\(fields found: tools\) has no "messages" .*"completion"$'):   # not records
        chat_messages(Record({"tools": [{"type": "function"}]}, "f.json, line 1"))


def _chat_lines(count, word, bom=False):
    lines = "".join(json.dumps({"messages": [{"role": "user", "content": f"{word} {i}"},
                                             {"role": "assistant", "content": "ok"}]}) + "\n" for i in range(count))
    return (b"\xef\xbb\xbf" if bom else b"") + lines.encode()


def test_a_folder_of_chat_splits_gives_the_chosen_split_and_keys_its_rows_by_it(tmp_path):
    folder = tmp_path / "chat"
    folder.mkdir()
    (folder / "train_sft.jsonl").write_bytes(_chat_lines(5, "train"))
    (folder / "test_sft.jsonl").write_bytes(_chat_lines(2, "test"))
    assert len(list(iter_records(str(folder)))) == 5
    assert [r.fields["messages"][0]["content"] for r in iter_records(str(folder), split="test")] == ["test 0", "test 1"]
    with pytest.raises(DataError, match="has no split 'dev'; its splits: test, train"):
        list(iter_records(str(folder), split="dev"))
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    rows = {split: prepare_sft_rows(str(folder), CharTokenizer(), template,
                                    SftOptions("chat", seq_len=64, val_fraction=0.0, split=split),
                                    cache_dir=tmp_path / "cache") for split in ("train", "test")}
    assert rows["train"].num_documents == 5 and rows["test"].num_documents == 2   # not the train split's cache


def test_a_chat_folder_as_a_hub_download_leaves_it_reads_past_its_card_and_names_a_stray_file(tmp_path):
    folder = tmp_path / "chat"
    folder.mkdir()
    (folder / "README.md").write_text("# dataset card\n")   # skipped: documentation beside the records
    (folder / "chats.jsonl").write_bytes(_chat_lines(4, "hello"))
    assert len(list(iter_records(str(folder)))) == 4
    (folder / "config.json").write_text(json.dumps({"vocab_size": 3}))   # a metadata file datasets never reads
    assert len(list(iter_records(str(folder)))) == 4
    (folder / "stray.json").write_text(json.dumps({"vocab_size": 3}))   # a record like any other: named as one
    with pytest.raises(DataError, match=r"record .*stray\.json, line 1 \(fields found: vocab_size\) has no "
                                        r"\"messages\""):
        [chat_messages(record) for record in iter_records(str(folder))]


def test_chat_records_with_a_bom_compressed_or_saved_to_disk_are_read(tmp_path):
    import gzip

    import datasets

    (tmp_path / "notepad.jsonl").write_bytes(_chat_lines(3, "bom", bom=True))
    assert len(list(iter_records(str(tmp_path / "notepad.jsonl")))) == 3
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as file:
        file.write(_chat_lines(4, "gz"))
    assert [r.where for r in iter_records(str(tmp_path / "c.jsonl.gz"))][-1] == f"{tmp_path / 'c.jsonl.gz'}, line 4"
    records = datasets.Dataset.from_list([json.loads(line) for line in _chat_lines(3, "saved").decode().splitlines()])
    datasets.DatasetDict(train_sft=records, test_sft=records.select([0])).save_to_disk(str(tmp_path / "saved"))
    assert len(list(iter_records(str(tmp_path / "saved"), split="train_sft"))) == 3
    assert len(list(iter_records(str(tmp_path / "saved"), split="test_sft"))) == 1


def test_a_hub_source_is_read_at_the_split_asked_for_with_its_tool_calls_as_written(monkeypatch, tmp_path):
    """A Hub dataset is parquet files, streamed by `datasets` with every key of the column's structs: its tool
    calls came with every record's arguments, as a local parquet file's did (the test below)."""
    import datasets

    originals = _tool_calling_records()
    datasets.Dataset.from_list(originals).to_parquet(str(tmp_path / "hub.parquet"))
    stream = datasets.load_dataset("parquet", data_files=str(tmp_path / "hub.parquet"), split="train", streaming=True)
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda **kwargs: asked.append(kwargs) or stream)
    records = list(iter_records("hf:owner/chats", split="train_sft"))
    assert asked[0]["split"] == "train_sft" and asked[0]["path"] == "owner/chats"
    assert [conversation_of(record, "chat") for record in records] == \
        [conversation_of(Record(fields, "json"), "chat") for fields in originals]
    assert records[-1].where == "hf:owner/chats, record 3"


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tool_calls_tool_results_and_tools_are_kept_as_transformers_takes_them():
    """OpenAI's form: a call's content is null; the tool's answer names its call; the record's tools go to the
    template. Reading only role and content trained an empty answer where the call was."""
    fields = {"messages": [{"role": "user", "content": "weather?", "tool_calls": None},
                           {"role": "assistant", "content": None, "tool_calls": [CALL]},
                           {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}],
              "tools": [TOOL]}
    conversation = conversation_of(Record(fields, "f, line 1"), "chat")
    assert conversation.messages == [{"role": "user", "content": "weather?"},   # a null (Parquet) column: no key
                                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                     {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]
    assert conversation.tools == [TOOL]
    # LLaMA-Factory stores the tools as JSON text; an empty column is no tools
    assert conversation_of(Record({**fields, "tools": json.dumps([TOOL])}, "f"), "chat").tools == [TOOL]
    assert conversation_of(Record({**fields, "tools": ""}, "f"), "chat").tools is None
    with pytest.raises(DataError, match=r'^record f, line 2: "tools" is a string that is not JSON \(Expecting value'):
        conversation_of(Record({**fields, "tools": "get_weather(city)"}, "f, line 2"), "chat")


def test_sharegpt_system_tools_function_call_and_observation_are_read_as_llama_factory_reads_them():
    fields = {"system": "You are a pirate.", "tools": json.dumps([TOOL]), "conversations": [
        {"from": "human", "value": "weather?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Arr, sunny."}]}
    conversation = conversation_of(Record(fields, "f, line 1"), "chat")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert conversation.messages == [
        {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Arr, sunny."}]
    assert conversation.tools == [TOOL]
    # the same prompt as the conversation's own system message is written once; a different one is refused
    system = {"from": "system", "value": "You are a pirate."}
    same = {**fields, "conversations": [system, *fields["conversations"]]}
    assert chat_messages(Record(same, "f")) == conversation.messages
    with pytest.raises(DataError, match=r'^record f: a "system" field and a different system message open'):
        chat_messages(Record({**same, "system": "Be polite."}, "f"))


def test_an_unknown_sharegpt_role_is_named_with_the_roles_read():
    """It was passed on as a role of its own: no assistant turn, and a run refused for having no answers."""
    record = Record({"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "yo"}]}, "f, line 3")
    with pytest.raises(DataError, match=r"record f, line 3, message 1: \"from\" 'bing' is not a ShareGPT role read "
                                        r"here \(human, user, gpt, assistant, system, function_call, observation, "
                                        r"tool, function\); rename it in the data$"):
        chat_messages(record)


def test_alpaca_system_and_history_come_before_the_instruction():
    fields = {"system": "Be terse.", "history": [["hi", "hello"], ["2+2?", "4"]], "instruction": "3+3?",
              "input": "", "output": "6"}
    assert instruct_messages(Record(fields, "w")) == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"}]
    with pytest.raises(DataError, match=r'record w: "history" needs a list of \[instruction, response\] string '
                                        r"pairs \(item 1 is a string\)$"):
        instruct_messages(Record({**fields, "history": [["a", "b"], "c"]}, "w"))


def _chat_rows(path, conversations):
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


def test_a_record_without_an_answer_is_skipped_and_counted(tmp_path):
    """Packed, it took row space the loss never saw, and no line said so."""
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    source = _chat_rows(tmp_path / "d.jsonl", [answered] * 4 + [[{"role": "system", "content": "only this"}]] * 2)
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    packed = prepare_sft_rows(str(source), CharTokenizer(), template, SftOptions("chat", seq_len=40, val_fraction=0.0),
                              cache_dir=tmp_path / "cache")
    assert (packed.num_documents, packed.no_answer_examples) == (6, 2)
    assert sum(len(set(row[row > 0].tolist())) for row in packed.train[:, SEGMENTS]) == 4
    from spillway.recipes.train.data_pipeline import TrainingData
    assert "(6 examples, " in TrainingData({"corpus": packed}, None).describe()
    assert "; 2 without an answer to train on, skipped)" in TrainingData({"corpus": packed}, None).describe()
    every = prepare_sft_rows(str(source), CharTokenizer(), template,
                             SftOptions("chat", seq_len=40, val_fraction=0.0, train_on_prompt=True),
                             cache_dir=tmp_path / "cache")
    assert every.no_answer_examples == 0   # every token is a target: nothing to skip


def test_max_tokens_takes_whole_examples_from_the_head_and_keys_the_cache(tmp_path):
    """data.max_tokens was ignored for chat data, and the rows of a run without it were reused."""
    source = write_instruct(tmp_path / "d.jsonl", [f"answer {i}" for i in range(10)])
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    whole = prepare_sft_rows(str(source), CharTokenizer(), template, SftOptions("instruct", 40, val_fraction=0.0),
                             cache_dir=tmp_path / "cache")
    length = whole.num_tokens // 10   # every example is as long
    capped = prepare_sft_rows(str(source), CharTokenizer(), template,
                              SftOptions("instruct", 40, val_fraction=0.0, max_tokens=3 * length + length - 1),
                              cache_dir=tmp_path / "cache")
    assert not capped.from_cache and capped.path != whole.path
    assert (capped.num_documents, capped.num_tokens) == (3, 3 * length)
    assert np.array_equal(capped.train[:3, TOKENS], whole.train[:3, TOKENS])   # the head, one example a row
    with pytest.raises(DataError, match=r"0 examples within data.max_tokens=5 .* do not give a training example"):
        prepare_sft_rows(str(source), CharTokenizer(), template,
                         SftOptions("instruct", 40, val_fraction=0.0, max_tokens=5), cache_dir=tmp_path / "cache")


def write_long_prompts(path, prompts):
    path.write_text("".join(json.dumps({"instruction": prompt, "output": "ok"}) + "\n" for prompt in prompts))
    return path


def test_an_example_cut_before_its_answer_is_skipped_and_counted_and_all_of_them_refused(tmp_path):
    """Kept, its row had no target: steps of loss 0.0 and a validation loss of NaN, exit 0."""
    from spillway.recipes.train.data_pipeline import TrainingData

    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    source = write_long_prompts(tmp_path / "d.jsonl", ["q"] * 3 + ["p" * 80] * 2)   # two answers past a row
    packed = prepare_sft_rows(str(source), CharTokenizer(), template,
                              SftOptions("instruct", seq_len=40, val_fraction=0.0), cache_dir=tmp_path / "cache")
    # counted once, as cut before their answer, not also as truncated (a new user read both lines)
    assert (packed.num_documents, packed.overlong_examples, packed.answer_cut_examples) == (5, 0, 2)
    assert all(row[TARGETS].any() for row in packed.train)   # every row holds something to train on
    described = TrainingData({"corpus": packed}, None).describe()
    assert "; 2 cut before their answer, skipped (raise data.seq_len" in described
    every_cut = write_long_prompts(tmp_path / "cut.jsonl", ["p" * 80] * 4)
    with pytest.raises(DataError, match=r"4 examples and no token to train on: every answer lies past the end of a row "
                                        r"of 41 tokens \(data.seq_len=40\) \(4 examples cut before their answer"):
        prepare_sft_rows(str(every_cut), CharTokenizer(), template,
                         SftOptions("instruct", seq_len=40, val_fraction=0.0), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"4 examples and none kept: every one with an answer is longer than a row of "
                                        r"41 tokens .* data.overlong=drop dropped it \(4\); raise data.seq_len"):
        prepare_sft_rows(str(every_cut), CharTokenizer(), template,
                         SftOptions("instruct", seq_len=40, val_fraction=0.0, overlong="drop"),
                         cache_dir=tmp_path / "cache")


def test_an_example_whose_answers_are_all_empty_is_skipped_as_one_without_an_answer(tmp_path):
    """Its only target was the end of turn: 48 such examples taught the model to stop at once, unsaid."""
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    empty = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]
    called = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                                     "function": {"name": "f", "arguments": {}}}]}]
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    source = _chat_rows(tmp_path / "d.jsonl", [answered] * 3 + [empty] * 2)
    packed = prepare_sft_rows(str(source), CharTokenizer(), template, SftOptions("chat", seq_len=40, val_fraction=0.0),
                              cache_dir=tmp_path / "cache")
    assert (packed.num_documents, packed.no_answer_examples) == (5, 2)
    from spillway.data.sft_packing import _answers
    assert _answers(called) and not _answers(empty) and _answers(answered)
    with pytest.raises(DataError, match=r"no example has an assistant message with something in it"):
        prepare_sft_rows(str(_chat_rows(tmp_path / "e.jsonl", [empty] * 3)), CharTokenizer(), template,
                         SftOptions("chat", seq_len=40, val_fraction=0.0), cache_dir=tmp_path / "cache")


def test_an_example_whose_answers_all_have_weight_0_is_skipped_and_a_weight_is_0_or_1(tmp_path):
    """OpenAI's "weight": 0 answers are context: an example of no other answer has nothing to train on."""
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 1}]
    unweighted = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]
    source = _chat_rows(tmp_path / "d.jsonl", [answered] * 3 + [unweighted] * 2)
    packed = prepare_sft_rows(str(source), CharTokenizer(), template, SftOptions("chat", seq_len=40, val_fraction=0.0),
                              cache_dir=tmp_path / "cache")
    assert (packed.num_documents, packed.no_answer_examples) == (5, 2)
    with pytest.raises(DataError, match=r'record f, line 2, message 1: "weight" is "0"; OpenAI\'s weight of a '
                                        r"message is 0 \(kept as context, not trained\) or 1 \(trained\)$"):
        chat_messages(Record({"messages": [answered[0], {**answered[1], "weight": "0"}]}, "f, line 2"))


def test_small_record_problems_say_what_they_are(tmp_path):
    """A history pair of three items said 'item 0 is a list'; a folder as the template 'nor a file that exists';
    a data.max_tokens too small for one example 'use more records'."""
    with pytest.raises(DataError, match=r"\"history\" needs a list of \[instruction, response\] string pairs \(item 0 "
                                        r"is a list of 3 items\)"):
        instruct_messages(Record({"instruction": "q", "output": "a", "history": [["a", "b", "c"]]}, "f, line 1"))
    with pytest.raises(DataError, match=r"item 0 is a list holding null"):
        instruct_messages(Record({"instruction": "q", "output": "a", "history": [["a", None]]}, "f, line 1"))
    with pytest.raises(DataError, match=r"data.chat_template '.*' is a folder: name the template file in it"):
        resolve_chat_template(str(tmp_path), None)
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    source = _chat_rows(tmp_path / "d.jsonl", [answered])
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    with pytest.raises(DataError, match=r"within data.max_tokens=3 .* do not give a training example; raise "
                                        r"data.max_tokens$"):
        prepare_sft_rows(str(source), CharTokenizer(), template,
                         SftOptions("chat", seq_len=40, val_fraction=0.0, max_tokens=3), cache_dir=tmp_path / "cache")


def test_content_as_a_list_of_text_parts_is_their_text_and_other_parts_are_named():
    """OpenAI's and transformers' multimodal form: it was refused as content that is not a string."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                                       {"type": "text", "text": "world"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]}
    assert [m["content"] for m in chat_messages(Record(parts, "f, line 1"))] == ["Hello, world", "hi"]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match=r"f, line 2, message 0, content part 0: of type 'image_url'; the models here "
                                        r"read text only"):
        chat_messages(Record(image, "f, line 2"))


def test_chat_records_in_a_json_array_whose_messages_differ_in_keys_are_read_as_they_are(tmp_path):
    """A new user's finding: a `.json` array of chat records, one of whose messages carried a "name" key, came
    back from `datasets` with every message a JSON string, refused at record 1 as "not an object"."""
    conversations = [{"messages": [{"role": "user", "content": f"question {i}"},
                                   {"role": "assistant", "content": f"answer {i}"}]} for i in range(5)]
    conversations[3]["messages"][0]["name"] = "alice"
    (tmp_path / "chat.json").write_text(json.dumps(conversations, indent=1))
    records = list(iter_records(str(tmp_path / "chat.json")))
    assert [record.fields for record in records] == conversations
    assert records[-1].where == f"{tmp_path / 'chat.json'}, record 5"
    (tmp_path / "chat.json").write_text(json.dumps(conversations)[:-5])   # cut short
    with pytest.raises(DataError, match=r"chat.json', line 1, column \d+: not valid JSON"):
        list(iter_records(str(tmp_path / "chat.json")))


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_an_empty_conversation_is_skipped_and_counted_as_one_without_an_answer(tmp_path, train_on_prompt):
    """One `{"messages": []}` among the records stopped the whole run, where a record whose answers are all empty
    is skipped and counted; an empty conversation has nothing to train on either (not even a prompt)."""
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    source = _chat_rows(tmp_path / "d.jsonl", [answered] * 3 + [[]] + [answered])
    template = resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)
    packed = prepare_sft_rows(str(source), CharTokenizer(), template,
                              SftOptions("chat", seq_len=40, val_fraction=0.0, train_on_prompt=train_on_prompt),
                              cache_dir=tmp_path / "cache")
    assert (packed.num_documents, packed.no_answer_examples) == (5, 1)
    assert chat_messages(Record({"messages": [], "system": "s"}, "f, line 1")) == [{"role": "system", "content": "s"}]


def _tool_calling_records():
    """Conversations whose calls and tools name different arguments, as every real tool-calling set's do."""
    def record(name, arguments, properties):
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object",
                                                                              "properties": properties}}}
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]},
                             {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}],
                "tools": [tool]}
    return [record("get_weather", {"city": "Paris"}, {"city": {"type": "string"}}),
            record("search", {"query": "x", "limit": 3}, {"query": {"type": "string"}, "limit": {"type": "integer"}}),
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]


def test_tool_calls_read_from_parquet_or_save_to_disk_hold_their_own_arguments_alone(tmp_path):
    """A new user's finding: written by `datasets` (to_parquet, save_to_disk), objects are Arrow structs of every
    key any record's had, null where a record had none, so each call came back with every call's arguments
    (`{"city": "Paris", "query": null, "limit": null}`) and each tool with every parameter, trained as text. And a
    column `datasets` keeps as JSON text (its Json feature, as its json builder reads objects whose keys differ)
    was refused as strings. From every form a conversation is what its JSON record gives the template."""
    import datasets

    originals = _tool_calling_records()
    expected = [conversation_of(Record(fields, "json"), "chat") for fields in originals]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(fields) + "\n" for fields in originals))
    structs = datasets.Dataset.from_list(originals)
    as_json_text = datasets.load_dataset("json", data_files=str(tmp_path / "d.jsonl"), split="train")
    assert isinstance(as_json_text.features["messages"].feature, datasets.Json)
    for name, dataset in (("structs", structs), ("json_text", as_json_text)):
        dataset.to_parquet(str(tmp_path / f"{name}.parquet"))
        dataset.save_to_disk(str(tmp_path / f"{name}_saved"))
        for source in (f"{name}.parquet", f"{name}_saved"):
            assert [conversation_of(record, "chat") for record in iter_records(str(tmp_path / source))] == \
                expected, source
