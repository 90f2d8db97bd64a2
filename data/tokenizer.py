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

`save_to_directory` writes the tokenizer file and a `tokenizer_config.json`
naming its EOS and BOS tokens, so `load_tokenizer(directory)` gives the same
tokenizer back; a run directory holds one (`spillway generate` reads it).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

from .cache import atomic_write_bytes

HF_TOKENIZER_FILE = "tokenizer.json"
SPM_TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_FILES = (HF_TOKENIZER_FILE, SPM_TOKENIZER_FILE)   # in the order a directory is searched
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Where the special tokens of a tokenizer are looked up, beside its file, in this order.
_TOKEN_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json")
_TOKEN_ID_FILES = ("generation_config.json", "config.json")


class NoEosTokenError(ValueError):
    """The tokenizer has no end-of-sequence token, and nothing beside it names one."""


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """EOS/BOS as named by the files beside a tokenizer: token strings, or (config.json) ids."""

    eos_token: str | None = None
    bos_token: str | None = None
    eos_id: int | None = None
    source: str | None = None         # the file the EOS came from, for messages

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
        raise ValueError(f"{path} is not readable JSON: {error}") from None
    return data if isinstance(data, dict) else {}


def read_special_tokens(directory: str | os.PathLike) -> SpecialTokens:
    """The EOS and BOS tokens named by the tokenizer's sibling files (see the module docstring)."""
    directory = Path(directory)
    eos = bos = None
    source = None
    for name in _TOKEN_FILES:
        path = directory / name
        if not path.is_file():
            continue
        data = _read_json(path)
        if eos is None and _token_text(data.get("eos_token")):
            eos, source = _token_text(data.get("eos_token")), str(path)
        bos = bos or _token_text(data.get("bos_token"))
    if eos is not None:
        return SpecialTokens(eos_token=eos, bos_token=bos, source=source)
    for name in _TOKEN_ID_FILES:
        path = directory / name
        if path.is_file():
            eos_id = _first_id(_read_json(path).get("eos_token_id"))
            if eos_id is not None:
                return SpecialTokens(bos_token=bos, eos_id=eos_id, source=str(path))
    return SpecialTokens(bos_token=bos)


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

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A hash of everything that decides the ids (vocabulary, rules, EOS): equal -> same tokens."""

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
        """`file_name` and a tokenizer_config.json naming EOS/BOS in `directory`; load_tokenizer reads it back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = self.save(directory / self.file_name)
        config = {"eos_token": self.token_text(self.eos_id)}
        if self.bos_id is not None:
            config["bos_token"] = self.token_text(self.bos_id)
        atomic_write_bytes(directory / TOKENIZER_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
        return path


def tokenizer_file_in(directory: str | os.PathLike) -> Path | None:
    """The tokenizer file a directory holds (tokenizer.json first, then tokenizer.model), or None."""
    for name in TOKENIZER_FILES:
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Fail unless every token id the tokenizer can emit has a row in the model's embedding.

    A tokenizer vocabulary larger than the model's would index past the
    embedding table (on GPU, silently: out-of-range gathers are clamped).
    A smaller one is fine and deliberate: model vocabularies are commonly
    padded up to a multiple of 64 or 128 for matmul efficiency (see
    `padded_vocab_size`). The unused rows are never inputs, and as outputs
    they only ever receive gradient pushing their logits down, so they cost a
    sliver of compute and nothing in quality.
    """
    if tokenizer.vocab_size > model_vocab_size:
        source = f" (tokenizer {tokenizer.path})" if tokenizer.path is not None else ""
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size} ids) is larger than the model's "
            f"embedding ({model_vocab_size} rows){source}; set the model's vocab_size to at least "
            f"{tokenizer.vocab_size} (e.g. {padded_vocab_size(tokenizer.vocab_size)}) or use "
            f"a smaller tokenizer"
        )


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """`vocab_size` rounded up to a multiple, the size to give a model's embedding."""
    return -(-vocab_size // multiple) * multiple
