"""Chat templates: a tokenizer's own Jinja `chat_template`, a built-in one by name, or one from a file.

Rendering follows transformers' `apply_chat_template`: an
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension, a `tojson` filter that does not escape HTML, the
globals `raise_exception` and `strftime_now`, and the special tokens
(`bos_token`, `eos_token`, ...) from the same `tokenizer_config.json` as the
template; a message's reasoning under any of its dataset names is given as
`reasoning_content` (and `thinking`), as transformers 5 gives it.
`{% generation %} ... {% endgeneration %}` marks the text the model
is trained to write (the assistant's answers); a template without such blocks
has its answers found by rendering the conversation turn by turn
(data/sft_targets.py).

Where the template comes from (`resolve_chat_template`):

* `data.chat_template` names a built-in template (`BUILTIN_TEMPLATES`) or a
  file holding one (a `.jinja` file, or a `tokenizer_config.json` with a
  `chat_template`);
* unset: the tokenizer's own, from the `chat_template.jinja` beside it, else
  its `tokenizer_config.json` (transformers reads them in that order: the
  file takes priority over the config's entry). A tokenizer with named
  templates (data/chat_template_files.py) renders with its default, and a
  conversation given tools with its "tool_use" one, as transformers does.

A tokenizer with no template and none named is a DataError saying what to set.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_template_files import (CHAT_TEMPLATE_FILE, DEFAULT, TOKENIZER_CONFIG_FILE, TOOL_USE, ChatTemplateError,
                                  read_config, templates_in_config, tokenizer_templates)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # transformers 5's order

# Built-in templates for tokenizers that have none (a sentencepiece model spillway trained). Their
# end-of-turn token is the tokenizer's EOS; `{% generation %}` marks each answer and that EOS.
_BOS_FIRST = "{% if bos_token %}{{ bos_token }}{% endif %}"   # left out where the tokenizer adds no BOS
BUILTIN_TEMPLATES = {
    # Plain-text markers: nothing the tokenizer needs beyond its BOS/EOS.
    "spillway": (
        _BOS_FIRST +
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
        "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n\n"
        "{% if loop.last or messages[loop.index0 + 1]['role'] == 'assistant' %}### Assistant:\n{% endif %}"
        "{% elif message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{{ '\n\n' }}"
        "{% else %}{{ raise_exception('unknown role ' ~ message['role'] ~ ': the spillway template knows "
        "system, user and assistant') }}{% endif %}"
        "{% endfor %}"
    ),
    # ChatML (Qwen, many others) with the tokenizer's EOS closing each turn: for tokenizers without
    # <|im_start|>/<|im_end|> tokens, where the markers are plain text.
    "chatml": (
        _BOS_FIRST +
        "{% for message in messages %}"
        "{% if message['role'] not in ('system', 'user', 'assistant') %}{{ raise_exception('unknown role ' ~ "
        "message['role'] ~ ': the chatml template knows system, user and assistant') }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ message['content'] }}{{ eos_token }}{{ '\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}
# The spillway template needs no generation prompt: a user turn that the assistant answers, or that ends the
# conversation, ends with the assistant's marker (two user turns in a row have none between them). (Newlines
# after a block tag are written as expressions: trim_blocks, as transformers renders, drops the first one.)
_ROLES_OF_BUILTINS = {"spillway": ("system", "user", "assistant"), "chatml": ("system", "user", "assistant")}


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: records the rendered character span of each block.

    The spans are offsets into the whole rendered text: the template is rendered as a stream
    (`Template.generate`), and a block's start is the length of what was emitted before it.
    """

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.emitted: list[str] | None = None
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

    def _record(self, caller):
        text = caller()
        if self.emitted is not None:
            start = sum(len(piece) for piece in self.emitted)
            self.spans.append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping (jinja's built-in one escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


@dataclasses.dataclass
class Rendered:
    """A rendered conversation and the character spans of its `{% generation %}` blocks (maybe none)."""

    text: str
    generation_spans: list[tuple[int, int]]


class ChatTemplate:
    """One compiled chat template, its special tokens, and where it came from (for messages)."""

    def __init__(self, source: str, *, origin: str, special_tokens: dict[str, str] | None = None,
                 named: dict[str, str] | None = None):
        """`named`: the tokenizer's other named templates beside this default one (chat_template_files.py);
        a conversation given tools renders with its "tool_use" one, as transformers does (`for_tools`)."""
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        self.named = {name: text for name, text in (named or {}).items() if name != DEFAULT}
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        self._tracker = next(e for e in environment.extensions.values() if isinstance(e, _GenerationBlocks))
        self._tool_use: ChatTemplate | None = None
        try:
            self._template = environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ChatTemplateError(f"chat template {origin} does not compile (line {error.lineno}: "
                                    f"{error.message})") from None

    @property
    def all_named(self) -> dict[str, str]:
        """Every template of the set, the default first: what a run saves and exports."""
        return {DEFAULT: self.source, **self.named}

    def for_tools(self, tools) -> ChatTemplate:
        """The template a conversation renders with: the "tool_use" one where it is given tools and the set has
        one (transformers' `get_chat_template`), else this one."""
        if tools is None or TOOL_USE not in self.named:
            return self
        if self._tool_use is None:
            self._tool_use = ChatTemplate(self.named[TOOL_USE], origin=f"{self.origin} ({TOOL_USE})",
                                          special_tokens=self.special_tokens)
        return self._tool_use

    @property
    def has_generation_blocks(self) -> bool:
        return "generation" in self.source and "endgeneration" in self.source

    @property
    def known_roles(self) -> tuple[str, ...] | None:
        """The roles a built-in template renders; None for a template whose roles are its own business."""
        return _ROLES_OF_BUILTINS.get(self.origin.removeprefix("built-in "))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               tools: list | None = None) -> Rendered:
        """The conversation as text, and its generation spans; ChatTemplateError with the template's own error.

        `tools`: the function descriptions the conversation may call, the template's `tools` (None: none);
        `documents` is None, as transformers passes both to every template it renders."""
        self._tracker.emitted, self._tracker.spans = [], []
        try:
            for piece in self._template.generate(messages=_with_reasoning_aliases(messages), tools=tools,
                                                 documents=None,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self.special_tokens):
                self._tracker.emitted.append(piece)
            text = "".join(self._tracker.emitted)
            return Rendered(text, list(self._tracker.spans))
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"chat template {self.origin} failed to render: "
                                    f"{' '.join(str(error).split())}") from None
        except Exception as error:   # a template's own Python-level failure (a None + str, say)
            raise ChatTemplateError(f"chat template {self.origin} failed to render: {type(error).__name__}: "
                                    f"{' '.join(str(error).split())}") from None
        finally:
            self._tracker.emitted = None


def _with_reasoning_aliases(messages: list[dict]) -> list[dict]:
    """Messages as transformers 5 gives them to a template: a message's reasoning, under any of the names datasets
    give it (`reasoning_content`, `thinking`, `reasoning`: the first set), is also its `reasoning_content` and,
    unless it has one, its `thinking`, so a template reading either (Qwen3's, gpt-oss') writes it."""
    aliased = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_of(directory: Path | None) -> dict[str, str]:
    """bos_token, eos_token, ... as the tokenizer_config.json in `directory` names them."""
    if directory is None or not (directory / TOKENIZER_CONFIG_FILE).is_file():
        return {}
    config = read_config(directory / TOKENIZER_CONFIG_FILE)
    return {key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None}


def resolve_chat_template(named: str | None, tokenizer_dir: Path | None,
                          special_tokens: dict[str, str] | None = None, *, bos_first: bool = False) -> ChatTemplate:
    """The template a run renders with (module docstring); `special_tokens` fill in what the file lacks.

    A built-in template writes the BOS only when `bos_first` (the tokenizer puts one before every document,
    `Tokenizer.adds_bos`): a conversation then starts as the model's pretraining documents did. Otherwise its
    text leaves the BOS out too, so the template saved with the run and exported with it (which transformers'
    apply_chat_template renders with the tokenizer's bos_token) starts a prompt as training started a row. A
    tokenizer's own template writes it as its authors chose; either way nothing else adds one."""
    special = {**(special_tokens or {}), **special_tokens_of(tokenizer_dir)}
    if named:
        if named in BUILTIN_TEMPLATES:
            source = BUILTIN_TEMPLATES[named]
            if not bos_first:
                special.pop("bos_token", None)
                source = source.removeprefix(_BOS_FIRST)
            return ChatTemplate(source, origin=f"built-in {named}", special_tokens=special)
        path = Path(named).expanduser()
        if path.is_dir():
            raise ChatTemplateError(f"data.chat_template {named!r} is a folder: name the template file in it (a "
                                    f".jinja file, or a tokenizer_config.json holding \"chat_template\")")
        if not path.is_file():
            raise ChatTemplateError(f"data.chat_template {named!r}: neither a built-in template "
                                    f"({', '.join(BUILTIN_TEMPLATES)}) nor a file that exists")
        if path.suffix == ".json":
            return _template_set(templates_in_config(read_config(path)), str(path), special,
                                 f"data.chat_template {named!r}: the file has no \"chat_template\"")
        return ChatTemplate(path.read_text(encoding="utf-8"), origin=str(path), special_tokens=special)
    found = tokenizer_templates(tokenizer_dir) if tokenizer_dir is not None else None
    where = f"the tokenizer in {tokenizer_dir}" if tokenizer_dir is not None else "the tokenizer"
    return _template_set(found[0] if found else {}, f"of {found[1]}" if found else where, special,
                         f"{where} has no chat template (no {CHAT_TEMPLATE_FILE}, no \"chat_template\" in its "
                         f"{TOKENIZER_CONFIG_FILE}) and data.chat_template names none: set data.chat_template to a "
                         f"built-in ({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file")


def _template_set(named: dict[str, str], origin: str, special: dict[str, str], none_said: str) -> ChatTemplate:
    """The default of a folder's or file's named templates, the others beside it; ChatTemplateError saying
    `none_said` where there are none, and naming them where none is the default (transformers then renders
    only with a name given, which a run does not give)."""
    if not named:
        raise ChatTemplateError(none_said)
    if DEFAULT not in named:
        raise ChatTemplateError(f"the chat templates {origin} are named {', '.join(sorted(named))}, none "
                                f"{DEFAULT!r}: name the one to train with in data.chat_template (its .jinja file)")
    return ChatTemplate(named[DEFAULT], origin=origin, special_tokens=special, named=named)
