"""The one Tokenizer interface, loading any supported tokenizer from a path, and the vocabulary check.

Two kinds sit behind `Tokenizer`:

- `SentencePieceTokenizer` (data/spm_tokenizer.py): a sentencepiece
  `tokenizer.model`, the kind this project trains, and the kind Mistral and
  Gemma checkpoints ship;
- `HFTokenizer` (data/hf_tokenizer.py): a Hugging Face `tokenizer.json`
  (the `tokenizers` library), which Llama 3 and Qwen checkpoints ship.

`load_tokenizer(path)` (data/tokenizer_loader.py, which imports both kinds,
so that neither imports back here through it) takes a `.json` file, a
`.model` file or a directory holding either; where a directory holds both
(many Hugging Face checkpoints do, and they describe the same tokenizer),
`tokenizer.json` is read, as transformers' fast tokenizers do.

End of sequence: the packing puts the EOS id after every document, so every
tokenizer must know it. `tokenizer.json` does not say which token it is; the
files beside it do: `tokenizer_config.json` or `special_tokens_map.json`
(`eos_token`), else `generation_config.json` or `config.json`
(`eos_token_id`). A sentencepiece model carries its own EOS id, which those
files override when they name one. A tokenizer that has none fails when asked
for it, with a message that says where it looked (`eos_id`).

Beginning of sequence: documents are tokenized as the family's tokenizer
does. `Tokenizer.adds_bos` says whether each document starts with `bos_id`
(data/encoding.py puts it there; `encode` itself never adds one). It is
decided, in this order, by: a choice made for the tokenizer (`with_bos`: the
recipe's `data.add_bos`, or the choice a resumed run started with); the
`add_bos_token` of the `tokenizer_config.json` beside it (Gemma, Mistral and
Llama 2 checkpoints set it); a `tokenizer.json`'s post-processor that puts a
special token before the text (Llama 3's `TemplateProcessing` puts
`<|begin_of_text|>` there; GPT-2's and Qwen's put none); else no BOS (a
sentencepiece model this project trained: no BOS unless the recipe asks).
Code that renders a chat template (whose text may begin with the BOS itself)
reads `adds_bos`: when it is true, either drop the template's own BOS text or
encode without `document_prefix()`, so a conversation gets one BOS, never two.

`save_to_directory` writes the tokenizer file and a `tokenizer_config.json`
naming its EOS and BOS tokens and `add_bos_token` (always: a run's record of
how it tokenized), so `load_tokenizer(directory)` gives the same tokenizer
back; a run directory holds one (`spillway generate` reads it).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

from .cache import atomic_write_bytes
from .chat_template_files import CHAT_TEMPLATE_DIR, named_template_files   # kept beside too

HF_TOKENIZER_FILE = "tokenizer.json"
SPM_TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_FILES = (HF_TOKENIZER_FILE, SPM_TOKENIZER_FILE)   # in the order a directory is searched
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Where the special tokens of a tokenizer are looked up, beside its file, in this order.
_TOKEN_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json")
_TOKEN_ID_FILES = ("generation_config.json", "config.json")
# Files beside a tokenizer that transformers reads with it, copied where it is saved (`save_to_directory`).
KEPT_BESIDE = ("special_tokens_map.json", "chat_template.jinja")


class NoEosTokenError(ValueError):
    """The tokenizer has no end-of-sequence token, and nothing beside it names one."""


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """EOS/BOS as named by the files beside a tokenizer: token strings, or (config.json) ids."""

    eos_token: str | None = None
    bos_token: str | None = None
    eos_id: int | None = None
    source: str | None = None         # the file the EOS came from, for messages
    add_bos: bool | None = None       # tokenizer_config.json's add_bos_token; None: the file does not say
    bos_choice: bool | None = None    # a choice made for this tokenizer (`with_bos`), which outranks the files
    # tokenizer_config.json's `legacy` and `add_prefix_space`: where transformers' sentencepiece-based tokenizers
    # write a dummy prefix ("▁") in a text cut by special tokens (data/spm_tokenizer.py `prefix_scheme`)
    legacy: bool | None = None
    add_prefix_space: bool | None = None
    # the other special tokens tokenizer_config.json names (added_tokens_decoder's special entries,
    # additional_special_tokens or transformers 5's extra_special_tokens: Gemma's <start_of_turn>/<end_of_turn>),
    # which a sentencepiece model holds as pieces of its own: a chat template's end of turn is found among them
    # (data/sft_targets.py)
    other_specials: tuple[str, ...] = ()
    # (text, lstrip, rstrip) of the special tokens whose added_tokens_decoder entry absorbs the whitespace beside
    # them, as transformers matches them in text
    stripping: tuple[tuple[str, bool, bool], ...] = ()

    @property
    def has_eos(self) -> bool:
        return self.eos_token is not None or self.eos_id is not None


def _token_text(value) -> str | None:
    # transformers writes special tokens as strings, or (older files) as {"content": "...", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_id(value) -> int | None:
    # generation_config.json may list several EOS ids (e.g. Llama 3 instruct); the first is the main one.
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not readable JSON: {error}; fix it, or copy it again from where the "
                         f"tokenizer came from (the checkpoint or run it belongs to)") from None
    return data if isinstance(data, dict) else {}


def named_special_token(directory: str | os.PathLike, field: str) -> str | None:
    """The text of a special token (`pad_token`, ...) as the tokenizer_config.json in `directory` names it."""
    path = Path(directory) / TOKENIZER_CONFIG_FILE
    try:
        return _token_text(_read_json(path).get(field)) if path.is_file() else None
    except ValueError:
        return None


def _added_tokens(config: dict) -> list[dict]:
    """tokenizer_config.json's added_tokens_decoder entries (objects), in its order."""
    decoder = config.get("added_tokens_decoder")
    return [entry for entry in (decoder.values() if isinstance(decoder, dict) else []) if isinstance(entry, dict)]


def added_token_ids(directory: str | os.PathLike) -> dict[str, int]:
    """{text: id} of the tokens transformers adds to a tokenizer from the files beside it: tokenizer_config.json's
    added_tokens_decoder (keyed by id) and added_tokens.json (text to id)."""
    directory = Path(directory)
    added: dict[str, int] = {}
    config_path = directory / TOKENIZER_CONFIG_FILE
    decoder = _read_json(config_path).get("added_tokens_decoder") if config_path.is_file() else None
    for key, entry in (decoder.items() if isinstance(decoder, dict) else []):
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(key).isdigit():
            added[entry["content"]] = int(key)
    listed = directory / "added_tokens.json"
    if listed.is_file():
        added.update({text: token_id for text, token_id in _read_json(listed).items()
                      if isinstance(token_id, int) and not isinstance(token_id, bool)})
    return added


def _other_specials(config: dict) -> tuple[str, ...]:
    """The texts of the special tokens a tokenizer_config.json names beyond BOS/EOS, in its order: transformers 5
    writes the additional ones as `extra_special_tokens` (a list, or a dict of named ones: Gemma 3's image
    markers), earlier versions as `additional_special_tokens`; it reads both."""
    entries = [entry for entry in _added_tokens(config) if entry.get("special")]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        entries += extra if isinstance(extra, list) else list(extra.values()) if isinstance(extra, dict) else []
    texts = [_token_text(entry) for entry in entries]
    return tuple(dict.fromkeys(text for text in texts if text))


def _stripping(config: dict) -> tuple[tuple[str, bool, bool], ...]:
    """(text, lstrip, rstrip) of each added_tokens_decoder entry that strips the whitespace on a side."""
    flags = [(entry.get("content"), entry.get("lstrip") is True, entry.get("rstrip") is True)
             for entry in _added_tokens(config)]
    return tuple((text, left, right) for text, left, right in flags if isinstance(text, str) and (left or right))


def read_special_tokens(directory: str | os.PathLike) -> SpecialTokens:
    """The EOS and BOS tokens named by the tokenizer's sibling files (see the module docstring)."""
    directory = Path(directory)
    eos = bos = None
    source = None
    flags: dict[str, bool] = {}   # add_bos, legacy, add_prefix_space: tokenizer_config.json's booleans
    for name in _TOKEN_FILES:
        path = directory / name
        if not path.is_file():
            continue
        data = _read_json(path)
        if eos is None and _token_text(data.get("eos_token")):
            eos, source = _token_text(data.get("eos_token")), str(path)
        bos = bos or _token_text(data.get("bos_token"))
        if name == TOKENIZER_CONFIG_FILE:
            flags = {field: data[key] for field, key in (("add_bos", "add_bos_token"), ("legacy", "legacy"),
                                                         ("add_prefix_space", "add_prefix_space"))
                     if isinstance(data.get(key), bool)}
            flags["other_specials"] = _other_specials(data)
            flags["stripping"] = _stripping(data)
    if eos is not None:
        return SpecialTokens(eos_token=eos, bos_token=bos, source=source, **flags)
    for name in _TOKEN_ID_FILES:
        path = directory / name
        if path.is_file():
            eos_id = _first_id(_read_json(path).get("eos_token_id"))
            if eos_id is not None:
                return SpecialTokens(bos_token=bos, eos_id=eos_id, source=str(path), **flags)
    return SpecialTokens(bos_token=bos, **flags)


def no_eos_message(path: Path | None, kind: str) -> str:
    where = f"{path}" if path is not None else f"this {kind}"
    return (f"{where}: no end-of-sequence token: the {kind} names none, and no "
            f"{' / '.join(_TOKEN_FILES)} (\"eos_token\") or {' / '.join(_TOKEN_ID_FILES)} (\"eos_token_id\") "
            f"beside it does; documents are packed with an EOS after each, so add "
            f"{{\"eos_token\": \"<the end token>\"}} to a {TOKENIZER_CONFIG_FILE} beside the tokenizer")


class Tokenizer(abc.ABC):
    """What the data pipeline, the train loop and sampling ask of a tokenizer.

    Implementations pickle cheaply (their serialized form, rebuilt lazily in
    each process), as `datasets.map(num_proc=...)` workers need.
    """

    file_name: str          # the name `save_to_directory` gives the tokenizer file
    path: Path | None
    special: SpecialTokens  # what the files beside it say (and a `with_bos` choice)
    # How a chat example's text becomes ids, where it is not the tokenizer's plain encoding of it (a part of
    # the chat rows' cache key: rows made another way are made again): None for most
    chat_encoding: str | None = None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """One more than the largest id `encode` can emit: the embedding rows the model needs."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """The end-of-sequence id; NoEosTokenError (a ValueError) naming where it looked if there is none."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None:
        """The beginning-of-sequence id, or None."""

    @abc.abstractmethod
    def id_of_token(self, text: str) -> int | None:
        """The id of the one token whose text is `text` (a special token or an ordinary piece), or None."""

    @property
    @abc.abstractmethod
    def family_adds_bos(self) -> bool:
        """Whether the tokenizer's own files put a BOS first, no choice made (module docstring): a
        tokenizer.json's post-processor; a sentencepiece model: no."""

    @property
    def adds_bos(self) -> bool:
        """Whether every document is tokenized with `bos_id` first: the flag a chat template that writes the
        BOS itself reads, so that it gets no second one (module docstring)."""
        for said in (self.special.bos_choice, self.special.add_bos):
            if said is not None:
                return said
        return self.family_adds_bos

    def document_prefix(self) -> list[int]:
        """The ids a document (or a prompt) starts with before its text: [bos_id] if `adds_bos`, else []."""
        if not self.adds_bos:
            return []
        if self.bos_id is None:
            raise ValueError(f"{self.path or 'the tokenizer'}: documents should start with a BOS (add_bos_token "
                             f"or data.add_bos=true), but the tokenizer has no BOS token: name one as "
                             f"\"bos_token\" in a {TOKENIZER_CONFIG_FILE} beside it, or set data.add_bos=false")
        return [self.bos_id]

    def with_bos(self, add: bool | None) -> Tokenizer:
        """A copy that puts a BOS before each document (True), none (False), or as its files say (None)."""
        chosen = copy.copy(self)
        chosen.special = dataclasses.replace(self.special, bos_choice=add)
        chosen.document_prefix()   # a BOS asked of a tokenizer that has none fails here, in one line
        return chosen

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A hash of everything that decides the ids (vocabulary, rules, EOS, a BOS added): equal -> same tokens.
        A tokenizer that adds no BOS keeps the fingerprint it had before BOS were added, so caches stay valid."""

    @property
    def splits_exactly_before_spaces(self) -> bool:
        """Whether encoding a text in pieces cut just before a single space between two words gives exactly the
        ids of encoding it whole (data/encoding.py cuts very long documents there to bound memory). False
        unless a tokenizer knows it: then long documents are encoded whole."""
        return False

    @abc.abstractmethod
    def encode(self, texts: list[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, with no BOS or EOS added."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of the ids (special tokens included as their text)."""

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer file itself (atomically) at `path`; returns it."""

    @abc.abstractmethod
    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (what `tokenizer_config.json` names special tokens by)."""

    def save_to_directory(self, directory: str | os.PathLike) -> Path:
        """`file_name` and a tokenizer_config.json naming EOS/BOS in `directory`; load_tokenizer reads it back.

        What the files beside the tokenizer said is kept (a Hugging Face checkpoint's tokenizer_class,
        pad_token, added tokens, chat template; its special_tokens_map.json, chat_template.jinja and named
        templates are copied): transformers loads the folder, or an export of it, as the tokenizer it was, and a model
        fine-tuned on text keeps its chat template. Only EOS, BOS and add_bos_token are this tokenizer's."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        beside = self.path.parent if self.path is not None else None
        config = {}
        if beside is not None and (beside / TOKENIZER_CONFIG_FILE).is_file():
            try:
                config = _read_json(beside / TOKENIZER_CONFIG_FILE)   # read before a save into the same folder
            except ValueError:
                config = {}   # unreadable: load_tokenizer said so already where it mattered
        kept = {name: (beside / name).read_bytes() for name in KEPT_BESIDE
                if beside is not None and (beside / name).is_file()}
        if beside is not None:   # transformers 5's named templates
            kept.update({f"{CHAT_TEMPLATE_DIR}/{path.name}": path.read_bytes()
                         for path in named_template_files(beside)})
        path = self.save(directory / self.file_name)
        # A tokenizer file of another kind left there (a run folder's earlier attempt, killed before its first
        # step, with data.tokenizer a tokenizer.json) is the one tokenizer_file_in reads first: a resume then
        # tokenized with it, or failed on this tokenizer's EOS. The folder holds this tokenizer alone.
        for name in TOKENIZER_FILES:
            if name != self.file_name and (directory / name).is_file():
                (directory / name).unlink()
        for name, data in kept.items():
            (directory / name).parent.mkdir(exist_ok=True)
            atomic_write_bytes(directory / name, data)
        config["eos_token"] = self.token_text(self.eos_id)
        if self.bos_id is not None:
            config["bos_token"] = self.token_text(self.bos_id)
        else:
            config.pop("bos_token", None)
        config["add_bos_token"] = self.adds_bos   # how the run tokenized (recipes/train/tokenization_record.py)
        atomic_write_bytes(directory / TOKENIZER_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
        return path


def tokenizer_file_in(directory: str | os.PathLike) -> Path | None:
    """The tokenizer file a directory holds (tokenizer.json first, then tokenizer.model), or None."""
    for name in TOKENIZER_FILES:
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int, weights_from: str | None = None) -> None:
    """Fail unless every token id the tokenizer can emit has a row in the model's embedding.

    A tokenizer vocabulary larger than the model's would index past the
    embedding table (on GPU, silently: out-of-range gathers are clamped).
    A smaller one is fine and deliberate: model vocabularies are commonly
    padded up to a multiple of 64 or 128 for matmul efficiency (see
    `padded_vocab_size`). The unused rows are never inputs, and as outputs
    they only ever receive gradient pushing their logits down, so they cost a
    sliver of compute and nothing in quality.

    `weights_from`: the checkpoint whose weights fix the embedding (a fine-tune's), named instead of the advice
    to grow vocab_size, which those weights do not allow.
    """
    if tokenizer.vocab_size > model_vocab_size:
        source = f" (tokenizer {tokenizer.path})" if tokenizer.path is not None else ""
        if weights_from is not None:
            raise ValueError(
                f"tokenizer vocabulary ({tokenizer.vocab_size} ids){source} is larger than the embedding of the "
                f"weights {weights_from} brings ({model_vocab_size} rows): those weights were not trained with "
                f"this tokenizer (tokens added to a tokenizer need the embedding resized with them, e.g. "
                f"transformers' resize_token_embeddings before saving); point data.tokenizer at their tokenizer")
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size} ids) is larger than the model's "
            f"embedding ({model_vocab_size} rows){source}; set the model's vocab_size to at least "
            f"{tokenizer.vocab_size} (e.g. {padded_vocab_size(tokenizer.vocab_size)}) or use "
            f"a smaller tokenizer"
        )


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """`vocab_size` rounded up to a multiple, the size to give a model's embedding."""
    return -(-vocab_size // multiple) * multiple
