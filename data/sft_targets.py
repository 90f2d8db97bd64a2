"""A conversation as token ids and the flags of the tokens the loss trains on (the assistant's answers).

Targets are the tokens of each assistant message (its tool calls too, as the
template writes them) and the end-of-turn token(s) the template writes right
after it; everything else (system, user and tool turns, the template's
markers) is not a target. `train_on_prompt` makes every token one.

Where the answers are in the rendered text:

* a template with `{% generation %}` blocks says so itself (their spans);
* any other template is rendered turn by turn: assistant message i starts
  where the conversation before it, rendered with the generation prompt, ends;
  its text runs to the end of its content and on through the special tokens
  that follow it (`<|eot_id|>`, `<|im_end|>`, `</s>`: whitespace before them
  allowed, as Llama 2 writes " </s>"); a turn with tool calls, written after
  its content in the template's own markers, runs to the last special token
  of its turn, and so does an empty content (Qwen3's template writes an empty
  `<think>` block before it);
* a template that renders an earlier turn differently once later ones follow
  (Qwen3's writes its `<think>` block into the answers after the last user
  message alone; Mistral v0.3's writes the tools before the last user message)
  is read from the whole rendering instead, as a copy of it with generation
  blocks marks the answers (`_WholeReading`): an assistant message is where the
  text changes with a probe in its place; its answer starts after the last
  generation prompt before it (what the template writes between them, a
  `<think>` block, is the answer's) or, where the prompt adds nothing
  (Mistral's), where the text before its content is what a conversation that
  ends with it writes there; it ends as it does there. An answer it cannot
  place so is a DataError asking for generation blocks.

An assistant message with OpenAI's `"weight": 0` is context, not an answer:
the spans inside its text (from the end of the conversation before it to its
own end; read from the whole rendering, from the end of the message before it
to the end of its turn) are dropped, in any way of finding them.

An assistant's tool call that is in no answer (a template that does not
render `tool_calls`) is a DataError naming the record: its answer would train
without the call.

Tokens: a `tokenizer.json` tokenizer encodes the whole rendered text (its
added tokens matched in it, no special tokens added: what transformers'
`apply_chat_template(tokenize=True)` gives) and a token is a target when its
character offsets overlap an answer. A sentencepiece model, which does not
match special tokens in text, encodes the text cut at its BOS/EOS texts
(which become their ids), each stretch between them whole, with its tokens'
offsets (as transformers' sentencepiece tokenizers split at special tokens).

No BOS is added here: the template writes it when the model wants one.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from spillway.layers.errors import DataError

from .chat_template import ChatTemplate, ChatTemplateError


def special_token_texts(tokenizer) -> dict[str, int]:
    """The texts of the tokenizer's special tokens, with their ids (for finding end-of-turn tokens)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        texts = {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()
                 if token.special}
    else:   # a sentencepiece model: the special tokens its tokenizer_config.json names that are its pieces
        texts = dict(getattr(tokenizer, "special_piece_ids", dict)())
    for token_id in (tokenizer.bos_id, tokenizer.eos_id):
        if token_id is not None:
            texts.setdefault(tokenizer.token_text(token_id), token_id)
    return texts


def _check_roles(template: ChatTemplate, messages: list[dict], where: str) -> None:
    roles = template.known_roles
    if roles is None:
        return
    for message in messages:
        if message["role"] not in roles:
            role = message["role"]
            fix = (f"write it {role.lower()!r}" if isinstance(role, str) and role.lower() in roles else
                   "give data.chat_template a template that knows it (a tokenizer_config.json or .jinja file), "
                   "or leave such turns out of the records")
            raise DataError(f"record {where}: role {role!r} is not one the chat template "
                            f"{template.origin} knows ({', '.join(roles)}): {fix}")


def _end_of_turn(text: str, start: int, limit: int, specials: dict[str, int]) -> int:
    """The end of the run of special tokens at `start` (whitespace before each allowed), else `start`."""
    end = position = start
    while position < limit:
        stripped = len(text[position:limit]) - len(text[position:limit].lstrip())
        match = next((s for s in sorted(specials, key=len, reverse=True)
                      if s and text.startswith(s, position + stripped) and position + stripped + len(s) <= limit),
                     None)
        if match is None:
            break
        position = end = position + stripped + len(match)
    return end


def _render(template: ChatTemplate, messages: list[dict], where: str, **options):
    """template.render, its error naming the record (one bad conversation among thousands must be findable)."""
    try:
        return template.render(messages, **options)
    except ChatTemplateError as error:
        # a template written without tool calls meets a null content (OpenAI's form of a call) as `None + str`
        null_call = any(_call_names(message) and message.get("content") is None for message in messages)
        hint = ("; a message has tool_calls and a null content: use a chat template that renders \"tool_calls\""
                if null_call and ("NoneType" in str(error) or "'None'" in str(error)) else "")
        raise ChatTemplateError(f"record {where}: {error}{hint}") from None


def _call_names(message: dict) -> list[str]:
    """The function names of a message's tool calls (OpenAI's {"function": {"name"}}, or {"name"} itself)."""
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    functions = [call.get("function", call) for call in calls if isinstance(call, dict)]
    return [f["name"] for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]]


_PROBE = "spillway-probe-7f3a"   # a content no template rewrites (no "</think>", no markup to strip)


def _check_rendered(template: ChatTemplate, messages: list[dict], text: str, where: str, tools) -> None:
    """DataError when a message is missing from the text: a role the template does not know, or a variable it
    misspells. A content the template rewrites (DeepSeek-R1's keeps only what follows "</think>") is told apart
    by rendering a probe in its place: the role is rendered when the probe is."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content.strip() and content.strip() not in text:
            probe = [*messages[:index], {**message, "content": _PROBE}, *messages[index + 1:]]
            if _PROBE in _render(template, probe, where, tools=tools).text:
                continue
            calls = _call_names(message) if message["role"] == "assistant" else []
            if calls and all(name in text for name in calls):   # the turn is written: its call, not its text
                raise DataError(f"record {where}: the chat template {template.origin} writes message {index}'s tool "
                                f"call but not the text beside it (it writes a tool-calling turn as the call alone, "
                                f"as Llama 3.1's does), so that text would not be trained; leave it out of the "
                                f"record's tool-calling turns, or give data.chat_template a template that writes it")
            shorter = _shorter_conversation_writing(template, messages, index, tools)
            if shorter is not None:
                raise DataError(f"record {where}: the chat template {template.origin} leaves message {index} (role "
                                f"{message['role']!r}) out of this conversation, though it writes it in the "
                                f"conversation's first {shorter} messages: it writes such a message only in some "
                                f"places (Mistral v0.3's writes the system message into the last user turn alone, "
                                f"so never in a conversation that ends with an answer); put its text into a user "
                                f"message, or give data.chat_template a template that writes it")
            said = "an empty template" if not text.strip() else (
                "a role the template does not know, or a misspelled variable, which Jinja writes as nothing "
                "(message.contnt)")
            raise DataError(f"record {where}: the chat template {template.origin} does not render role "
                            f"{message['role']!r} (its message is missing from the text): {said}")


def _shorter_conversation_writing(template: ChatTemplate, messages: list[dict], index: int, tools) -> int | None:
    """The length of the shortest start of the conversation whose rendering writes message `index`, None if none
    does: a template that knows the role and writes the message only where the conversation stops (Mistral
    v0.3's system message, written into a last user turn) is told apart from one that never writes it."""
    content = messages[index]["content"].strip()
    for length in range(index + 1, len(messages)):
        try:
            if content in template.render(messages[:length], tools=tools).text:
                return length
        except ChatTemplateError:   # a start the template refuses (its roles must alternate, say)
            continue
    return None


def _check_calls_trained(template: ChatTemplate, messages: list[dict], text: str, spans, where: str) -> None:
    """DataError when an assistant's tool call is not in an answer: a template that does not render tool calls
    gives the turn without its call, and the model would learn to answer a question that needs a tool with
    the text alone (often nothing at all). Stopped, not skipped: every tool-call record of the source meets the
    same template, so skipping would drop them all while the run looks fine; the fix is the template."""
    for message in messages:
        for name in _call_names(message) if message["role"] == "assistant" else []:
            if not any(name in text[start:end] for start, end in spans):
                raise DataError(f"record {where}: the chat template {template.origin} does not write the "
                                f"assistant's tool call {name!r} into its answer, which would be trained without "
                                f"the call; use a chat template that renders \"tool_calls\" (data.chat_template, "
                                f"or a tokenizer whose template does)")


def _answer_end(text: str, content_end: int, limit: int, specials: dict[str, int], calls: bool) -> int:
    """Where an answer ends: its content and the special tokens right after it. A turn with tool calls has them
    after its content, in markers the template chooses (`<tool_call>...</tool_call>`, bare JSON): it runs to
    the last special token of the turn (its end of turn), or to the turn's end (trailing whitespace out)."""
    if not calls:
        return _end_of_turn(text, content_end, limit, specials)
    found = {special: text.rfind(special, content_end, limit) for special in specials if special}
    ends = [start + len(special) for special, start in found.items() if start >= 0]
    return max(ends) if ends else content_end + len(text[content_end:limit].rstrip())


def answer_spans(template: ChatTemplate, messages: list[dict], specials: dict[str, int],
                 where: str, tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans of the answers and their end-of-turn tokens): module docstring."""
    template = template.for_tools(tools)
    _check_roles(template, messages, where)
    rendered = _render(template, messages, where, tools=tools)
    text = rendered.text
    _check_rendered(template, messages, text, where, tools)
    whole = _WholeReading(template, messages, text, where, tools)
    untrained = _untrained_regions(template, messages, text, where, tools, whole)
    trained = [message for message in messages if message.get("weight", 1) != 0]
    if template.has_generation_blocks:
        spans = rendered.generation_spans
    else:
        spans = _turn_by_turn_spans(template, messages, text, specials, where, tools)
        if spans is None:   # an earlier turn written otherwise once later ones follow: read from the whole text
            spans = whole.spans(specials)
    spans = _outside(spans, untrained)
    _check_calls_trained(template, trained, text, spans, where)
    return text, spans


def _turn_by_turn_spans(template: ChatTemplate, messages: list[dict], text: str, specials: dict[str, int],
                        where: str, tools) -> list[tuple[int, int]] | None:
    """The answers found turn by turn (module docstring); None where the template renders an earlier turn
    differently once later ones follow (the conversation through an answer is not the start of the text, or
    the one before it does not start it as the turn's opening does)."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(template, messages[:index], where, add_generation_prompt=True, tools=tools).text
        through = _render(template, messages[: index + 1], where, tools=tools).text
        if not text.startswith(through):
            return None
        if not text.startswith(prompt):
            prompt = _answer_opening(template, messages, index, text, where, tools)
            if prompt is None:
                return None
        content_end = _turn_content_end(template, messages, index, text, (len(prompt), len(through)), where, tools)
        # a content the template rewrote (found nowhere) runs, as a turn with tool calls, to its turn's end; so does
        # an empty one, which a template may write after a block of its own (Qwen3's "<think>\n\n</think>\n\n")
        to_turn_end = bool(_call_names(message)) or content_end is None or not (message.get("content") or "").strip()
        spans.append((len(prompt), _answer_end(text, len(prompt) if content_end is None else content_end,
                                               len(through), specials, to_turn_end)))
    return spans


def _turn_content_end(template: ChatTemplate, messages: list[dict], index: int, text: str, turn: tuple[int, int],
                      where: str, tools) -> int | None:
    """Where the content of assistant message `index` ends in its turn, text[turn[0]:turn[1]] (the conversation
    through it being the text's start); None where the template rewrote it (found nowhere). A content written
    twice there (a reasoning that says the answer before the answer) is told by probes in its place."""
    start, end = turn
    content = (messages[index].get("content") or "").strip()
    found = text.find(content, start, end) if content else start
    if not content or found < 0 or text.find(content, found + 1, end) < 0:
        return None if found < 0 else found + len(content)
    probed = _render(template, [*messages[:index], _probed(messages[index], _EDGED_PROBE)], where, tools=tools).text
    region = _changed(text[:end], probed)
    return found + len(content) if region is None else region[1]


def _untrained_regions(template: ChatTemplate, messages: list[dict], text: str, where: str, tools,
                       whole: _WholeReading) -> list[tuple[int, int]]:
    """The text of each assistant message of weight 0 (OpenAI's: kept as context, not trained), from the end of
    the conversation before it to its own end (a template that renders it otherwise once later turns follow:
    from the end of the message before it to the end of its turn, in the whole text). Left in the answers, the
    model learnt the very turns the data says not to (a wrong answer kept to show its correction)."""
    regions = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight", 1) != 0:
            continue
        before = _render(template, messages[:index], where, tools=tools).text
        through = _render(template, messages[: index + 1], where, tools=tools).text
        if text.startswith(before) and text.startswith(through):
            regions.append((len(before), len(through)))
        elif (turn := whole.turn(index)) is not None:   # (None: a message written nowhere, no answer to drop)
            regions.append((turn.floor, turn.limit))
    return regions


def _outside(spans, regions) -> list[tuple[int, int]]:
    """The answer spans that do not start inside an untrained message's region."""
    return [span for span in spans if not any(start <= span[0] < end for start, end in regions)]


def _answer_opening(template: ChatTemplate, messages: list[dict], index: int, text: str, where: str,
                    tools) -> str | None:
    """The text before assistant message `index` where the generation prompt writes the turn's opening otherwise
    than the conversation does (DeepSeek-R1's prompt ends with "<think>\n", which its conversations do not
    write; a prompt that adds a system line or prefills the answer): the turns before it, and the opening the
    template writes before the message's content, found by rendering a probe in its place. None where the
    conversation does not start so (the whole rendering is read instead)."""
    before = _render(template, messages[:index], where, tools=tools).text
    probe = _render(template, [*messages[:index], {**messages[index], "content": _PROBE}], where, tools=tools).text
    at = probe.find(_PROBE, len(before))
    opening = before + probe[len(before):at] if at >= 0 and probe.startswith(before) else None
    return opening if opening is not None and text.startswith(opening) else None


# The probe that finds where a message is written, as what changes with it: its edges are characters no content
# starts or ends with (one that did would be read as the text around it, the message one character shorter).
_EDGED_PROBE = f"\x00{_PROBE}\x00"


def _probed(message: dict, probe: str) -> dict:
    """The message with `probe` for its content and for the names of its tool calls (a template that writes the
    calls without the content, as Mistral v0.3's, still shows where the turn is)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return {**message, "content": probe}
    named = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            call = {**call, "function": {**function, "name": probe}}
        elif isinstance(call, dict) and isinstance(call.get("name"), str):
            call = {**call, "name": probe}
        named.append(call)
    return {**message, "content": probe, "tool_calls": named}


def _common_start(a: str, b: str) -> int:
    """The length of the longest start a and b share (by halving: each step one comparison of slices)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if a[:middle] == b[:middle] else (low, middle - 1)
    return low


def _changed(text: str, probed: str) -> tuple[int, int] | None:
    """(start, end) of what differs between `text` and its rendering with one message probed: where the template
    writes that message (its content, as rewritten, and its calls' names); None where the probe changes nothing
    (the message is written nowhere)."""
    if probed == text:
        return None
    head = _common_start(text, probed)
    tail = min(_common_start(text[::-1], probed[::-1]), min(len(text), len(probed)) - head)
    return head, len(text) - tail


@dataclasses.dataclass(frozen=True)
class _Turn:
    """Where an assistant message is in the whole text."""

    floor: int         # the end of the message written before it
    start: int         # where its answer starts: after its turn's opening
    content_end: int   # where its content (its calls) ends
    limit: int         # where its turn ends, as in a conversation that ends with it


class _WholeReading:
    """The answers of a template that renders an earlier turn differently once later ones follow (Qwen3's writes
    its <think> block into the answers after the last user message alone; Mistral v0.3's its tools before the
    last user message), read from the whole rendering, as a copy of the template with generation blocks marks
    them. Each assistant message is found by rendering a probe in its place: the text that changes is its
    content. Its answer starts after the last generation prompt (`<|im_start|>assistant\n`) before that (what
    the template writes between them, a <think> block, is the answer's), or, for a template whose generation
    prompt adds nothing (Mistral's), where the text before its content (" ", "[TOOL_CALLS] [...") is what a
    conversation that ends with it writes there (`_answer_start`); it ends as there, with the end-of-turn
    tokens that follow its content. ChatTemplateError where either is not so."""

    def __init__(self, template: ChatTemplate, messages: list[dict], text: str, where: str, tools):
        self.template, self.messages, self.text, self.where, self.tools = template, messages, text, where, tools
        self._regions: dict[int, tuple[int, int] | None] = {}
        self._turns: dict[int, _Turn | None] = {}

    def _render(self, messages: list[dict], **options) -> str:
        return _render(self.template, messages, self.where, tools=self.tools, **options).text

    def _probed_rendering(self, messages: list[dict], index: int) -> str:
        return self._render([*messages[:index], _probed(messages[index], _EDGED_PROBE), *messages[index + 1:]])

    def region(self, index: int) -> tuple[int, int] | None:
        """Where message `index` is written in the whole text (None: nowhere)."""
        if index not in self._regions:
            self._regions[index] = _changed(self.text, self._probed_rendering(self.messages, index))
        return self._regions[index]

    def turn(self, index: int) -> _Turn | None:
        """Where assistant message `index` and its answer are; None for one written nowhere (no answer)."""
        if index not in self._turns:
            self._turns[index] = self._read_turn(index)
        return self._turns[index]

    def spans(self, specials: dict[str, int]) -> list[tuple[int, int]]:
        spans = []
        for index, message in enumerate(self.messages):
            if message["role"] != "assistant" or (turn := self.turn(index)) is None:
                continue
            end = _answer_end(self.text, turn.content_end, turn.limit, specials, bool(_call_names(message)))
            if end > turn.start:   # (an empty answer the template leaves out: none)
                spans.append((turn.start, end))
        return spans

    def _read_turn(self, index: int) -> _Turn | None:
        region = self.region(index)
        if region is None:
            return None
        content_start, content_end = region
        floor = self._floor(index, content_start)
        generation_prompt, opening, ending = self._as_last(index)
        if not self.text.startswith(ending, content_end):
            raise self._refused(index, "end")
        return _Turn(floor, self._answer_start(index, floor, content_start, generation_prompt, opening), content_end,
                     content_end + len(ending))

    def _answer_start(self, index: int, floor: int, content_start: int, generation_prompt: str, opening: str) -> int:
        """After the last generation prompt between the message before and the content; else where the text
        before the content is the opening a conversation ending with it writes (Mistral's prompt adds nothing);
        else after the longest start of the generation prompt written there (Qwen3-Thinking's prompt ends with
        "<think>\n", which an earlier answer, its reasoning left out, does not write)."""
        at = self.text.rfind(generation_prompt, floor, content_start) if generation_prompt else -1
        if at >= 0:
            return at + len(generation_prompt)
        if content_start - len(opening) >= floor and self.text.startswith(opening, content_start - len(opening)):
            return content_start - len(opening)
        for length in range(len(generation_prompt) - 1, 0, -1):
            at = self.text.rfind(generation_prompt[:length], floor, content_start)
            if at >= 0:
                return at + length
        raise self._refused(index, "start")

    def _floor(self, index: int, position: int) -> int:
        """The end of the nearest message before message `index` that is written before `position` (Mistral
        v0.3's writes the system message into the last user turn, after the answers); 0 where none is."""
        for previous in range(index - 1, -1, -1):
            region = self.region(previous)
            if region is not None and region[1] <= position:
                return region[1]
        return 0

    def _as_last(self, index: int) -> tuple[str, str, str]:
        """In the conversation that ends with assistant message `index`: what the generation prompt adds to the
        conversation before it, the text between that prompt and its content, and the text after its content."""
        messages = self.messages[: index + 1]
        before = self._render(messages[:-1])
        prompt = self._render(messages[:-1], add_generation_prompt=True)
        through = self._render(messages)
        region = _changed(through, self._probed_rendering(messages, index))
        if region is None:
            raise self._refused(index, "text")
        generation_prompt = prompt[len(before):] if prompt.startswith(before) else ""
        # a prompt the conversation does not continue (DeepSeek-R1's "<think>\n"): the answer starts at its content
        opening = through[len(prompt):region[0]] if through.startswith(prompt) and len(prompt) <= region[0] else ""
        return generation_prompt, opening, through[region[1]:]

    def _refused(self, index: int, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"chat template {self.template.origin} writes assistant message {index} otherwise "
                                 f"in the whole conversation than in one that ends with it, so the {what} of its "
                                 f"answer cannot be found (record {self.where}); use a template with "
                                 f"{{% generation %}} blocks (data.chat_template)")


def _flags_from_offsets(offsets, spans) -> np.ndarray:
    flags = np.zeros(len(offsets), bool)
    for k, (start, end) in enumerate(offsets):
        flags[k] = any(start < span_end and max(end, start + 1) > span_start for span_start, span_end in spans)
    return flags


def _encode_between_specials(tokenizer, text: str, spans, specials: dict[str, int]) -> tuple[list[int], np.ndarray]:
    """A tokenizer that does not match special tokens in text (sentencepiece): the text is cut at its special
    tokens' texts, which become their ids, and each stretch between them is encoded whole (with or without the
    model's dummy prefix as transformers writes it: data/spm_tokenizer.py `prefix_scheme`), its tokens'
    offsets telling which are an answer's. (Cut at the answers' edges too, a model with a dummy prefix wrote a
    "▁" of its own before every answer, which neither it nor transformers writes for the whole text.)"""
    strip = getattr(tokenizer, "special_whitespace", dict)()   # lstrip/rstrip: whitespace absorbed, as transformers
    matched: list[tuple[int, int, int]] = []   # (start, end, id) of each special token, its absorbed whitespace in
    if specials:
        pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True) if s))
        for match in pattern.finditer(text):
            start, end = match.span()
            left, right = strip.get(match.group(), (False, False))
            floor = matched[-1][1] if matched else 0
            while left and start > floor and text[start - 1].isspace():
                start -= 1
            while right and end < len(text) and text[end].isspace() and not pattern.match(text, end):
                end += 1
            if start >= floor:   # (a match inside the whitespace the one before absorbed is no match)
                matched.append((start, end, specials[match.group()]))
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    position = 0
    for start, end, special in [*matched, (len(text), len(text), None)]:
        if start > position:
            stretch_ids, stretch_offsets = tokenizer.encode_with_offsets(text[position:start],
                                                                         starts_the_text=position == 0)
            ids.extend(stretch_ids)
            offsets.extend((position + a, position + b) for a, b in stretch_offsets)
        if special is not None:
            ids.append(special)
            offsets.append((start, end))
        position = max(position, end)
    return ids, _flags_from_offsets(offsets, spans)


def encode_with_targets(tokenizer, text: str, spans, specials: dict[str, int],
                        train_on_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, target flags) of a rendered conversation (module docstring)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        encoding = backend.encode(text, add_special_tokens=False)
        ids, flags = list(encoding.ids), _flags_from_offsets(encoding.offsets, spans)
    else:
        ids, flags = _encode_between_specials(tokenizer, text, spans, specials)
    if train_on_prompt:
        flags = np.ones(len(ids), bool)
    return np.asarray(ids, np.int64), flags


def conversation_tokens(template: ChatTemplate, tokenizer, messages: list[dict], specials: dict[str, int],
                        where: str, train_on_prompt: bool = False,
                        tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target flags) of one conversation (its `tools` the template's): render, find the answers, encode."""
    text, spans = answer_spans(template, messages, specials, where, tools)
    return encode_with_targets(tokenizer, text, spans, specials, train_on_prompt)


def prompt_tokens(template: ChatTemplate, tokenizer, messages: list[dict], specials: dict[str, int]) -> list[int]:
    """The ids a model continues to answer `messages` (rendered with the generation prompt)."""
    text = template.render(messages, add_generation_prompt=True).text
    ids, _ = encode_with_targets(tokenizer, text, [], specials)
    return [int(i) for i in ids]


# A tool for the end-of-turn probe of a tool_use template, which may read the tools it is given (tools[0]...).
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "a probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]


def _after_answer(template: ChatTemplate, specials: dict[str, int], tools: list | None = None) -> list[str]:
    """The special tokens the template writes right after an answer (in its answer span): one probe turn."""
    probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    text, spans = answer_spans(template, probe, specials, "(end-of-turn probe)", tools)
    tail = text[text.find("pong") + len("pong"):spans[-1][1]] if spans else ""
    return [special for special in specials if special and special in tail]


def end_of_turn_ids(template: ChatTemplate, tokenizer, specials: dict[str, int]) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS and the special tokens the template writes after one, or
    its tool_use template after one (the answers of records with tools trained with that one's)."""
    after = set(_after_answer(template, specials))
    if template.for_tools(_PROBE_TOOLS) is not template:   # rendered as a record with tools renders
        after |= set(_after_answer(template, specials, _PROBE_TOOLS))
    return sorted({tokenizer.eos_id} | {specials[special] for special in after})


def answer_end_warning(template: ChatTemplate, specials: dict[str, int]) -> str | None:
    """A warning when the template writes no special token after an answer (`{{ role }}: {{ content }}\\n`): the
    targets then hold no end of turn, and the model trained on them never learns to stop; None otherwise."""
    if _after_answer(template, specials):
        return None
    return (f"warning: chat template {template.origin} writes no end-of-turn token after an answer (no special "
            f"token, the tokenizer's EOS neither): a model trained on it never learns to stop; end each assistant "
            f"turn with the EOS ({{{{ eos_token }}}}) or the tokenizer's end-of-turn token")


def template_special_tokens(tokenizer) -> dict[str, str]:
    """eos_token / bos_token as the tokenizer itself names them, for a template whose files do not."""
    special = {"eos_token": tokenizer.token_text(tokenizer.eos_id)}
    if tokenizer.bos_id is not None:
        special["bos_token"] = tokenizer.token_text(tokenizer.bos_id)
    return special


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts every document with its BOS (`Tokenizer.adds_bos`; False where the
    tokenizer does not say): a built-in chat template then writes one too."""
    return bool(getattr(tokenizer, "adds_bos", False))

