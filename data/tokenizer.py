"""The one Tokenizer interface, loading any supported tokenizer from a path, and the vocabulary check.

Two kinds sit behind `Tokenizer`:

- `SentencePieceTokenizer` (data/spm_tokenizer.py): a sentencepiece
  `tokenizer.model`, the kind this project trains, and the kind Mistral and
  Gemma checkpoints ship;
- `HFTokenizer` (data/hf_tokenizer.py): a Hugging Face `tokenizer.json`
  (the `tokenizers` library), which Llama 3 and Qwen checkpoints ship.

`load_tokenizer(path)` takes a `.json` file, a `.model` file or a directory
holding either; where a directory holds both (many Hugging Face checkpoints
do, and they describe the same tokenizer), `tokenizer.json` is read, as
transformers' fast tokenizers do.

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

<<<<<<< HEAD
import numpy as np
import sentencepiece as spm

from spillway.layers.errors import DataError

from .cache import atomic_write_bytes, stable_key

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MODEL_TYPES = ("bpe", "unigram")
# Printable ASCII always gets its own piece. Character coverage alone would
# drop rare ASCII letters (in 8 MB of Python source, "Y" falls in the 0.05%
# tail) into byte pieces, a poor trade for code and English text; 94 pieces
# are cheap in any real vocabulary.
_ASCII_PRINTABLE = "".join(chr(code) for code in range(33, 127))
# Training lines kept by default. Unigram's EM passes cost about 0.2 ms of CPU
# per line (vocab 4096): on the default corpus, 50k lines train in 10 s of CPU
# against 38 s for all 190k, at the same compression (3.28 bytes/token). BPE
# takes 1.7 s for 200k lines.
DEFAULT_MAX_SENTENCES = {"bpe": 200_000, "unigram": 50_000}
# Bumped whenever the training recipe below changes, so old cache entries miss.
_TRAINING_RECIPE_VERSION = 1
=======
HF_TOKENIZER_FILE = "tokenizer.json"
SPM_TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_FILES = (HF_TOKENIZER_FILE, SPM_TOKENIZER_FILE)   # in the order a directory is searched
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Where the special tokens of a tokenizer are looked up, beside its file, in this order.
_TOKEN_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json")
_TOKEN_ID_FILES = ("generation_config.json", "config.json")
>>>>>>> hfinit


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
        from .cache import atomic_write_bytes

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


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a `.json` file (Hugging Face), any other file (sentencepiece), or a directory holding
    tokenizer.json or tokenizer.model. Special tokens come from the files beside it (module docstring)."""
    from .hf_tokenizer import HFTokenizer
    from .spm_tokenizer import SentencePieceTokenizer

    path = Path(path).expanduser()
    if path.is_dir():
        found = tokenizer_file_in(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds no tokenizer: neither {' nor '.join(TOKENIZER_FILES)}")
        path = found
    elif not path.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist")
    special = read_special_tokens(path.parent)
    if path.suffix == ".json":
        return HFTokenizer.from_file(path, special)
    return SentencePieceTokenizer.from_file(path, special)


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
<<<<<<< HEAD


def _iter_texts(documents: Iterable) -> Iterator[str]:
    # Accept a plain iterable of strings or a `datasets` dataset with a
    # "text" column (iterated in batches: one Python dict per row is slow).
    if hasattr(documents, "column_names") and hasattr(documents, "iter"):
        for batch in documents.iter(batch_size=1000):
            yield from batch["text"]
    else:
        yield from documents


def training_sentences(
    documents: Iterable, *, max_chars: int, max_sentence_chars: int, max_sentences: int, seed: int
) -> list[str]:
    """The lines sentencepiece trains on: non-blank, chunked, capped, sampled reproducibly.

    Reading stops after `max_chars` characters of lines (for a huge or streamed
    corpus, the head of it is the sample). When there are more than
    `max_sentences` lines, a seeded subset is kept in corpus order. We sample
    here rather than with sentencepiece's own shuffle because that one is
    seeded from the OS unless set globally, and the cache key must describe
    exactly what was trained on.
    """
    lines: list[str] = []
    total = 0
    for text in _iter_texts(documents):
        for line in (text or "").splitlines():
            if not line.strip():
                continue
            for start in range(0, len(line), max_sentence_chars):
                lines.append(line[start : start + max_sentence_chars])
            total += len(line)
        if total >= max_chars:
            break
    if len(lines) > max_sentences:
        keep = np.sort(np.random.default_rng(seed).choice(len(lines), max_sentences, replace=False))
        lines = [lines[i] for i in keep]
    return lines


def _explain_trainer_error(error: RuntimeError, vocab_size: int, byte_fallback: bool,
                           sentences: list[str]) -> Exception:
    message = str(error)
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if too_high:
        chars = sum(len(line) for line in sentences)
        return DataError(
            f"vocab_size={vocab_size} is too large for this corpus: sentencepiece can build at most "
            f"{too_high.group(2)} pieces from its {chars:,} characters ({len(sentences):,} lines); use a "
            f"vocab_size of at most {too_high.group(2)}, a corpus with more distinct text, or an "
            f"already trained tokenizer"
        )
    too_small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_small:
        fallback = (
            " (256 byte pieces for byte_fallback, 4 special ids, one per printable ASCII"
            " and common character)"
            if byte_fallback
            else " (4 special ids, one per character)"
        )
        return DataError(
            f"vocab_size={vocab_size} is too small: this corpus needs at least {too_small.group(2)} "
            f"pieces{fallback}; raise vocab_size"
        )
    return DataError(f"sentencepiece training failed (vocab_size={vocab_size}): {' '.join(message.split())}")


def train_tokenizer(
    documents: Iterable,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    byte_fallback: bool = True,
    cache_dir: str | os.PathLike | None = None,
    character_coverage: float | None = None,
    max_training_chars: int = 50_000_000,
    max_sentences: int | None = None,
    max_sentence_chars: int = 2048,
    num_threads: int | None = None,
    seed: int = 0,
) -> Tokenizer:
    """Train a sentencepiece tokenizer on documents (strings, or a dataset with "text").

    With `cache_dir`, the model is stored under a key of (the exact training
    sentences, every setting) and a second call with the same inputs loads it
    instead of training. On the default corpus at vocab 4096, BPE trains in
    about 2 s of CPU, unigram in about 10 s (it samples fewer lines, see
    `DEFAULT_MAX_SENTENCES`).

    `character_coverage` defaults to 0.9995 with byte fallback (rare characters
    become bytes) and 1.0 without it (so no character becomes `<unk>`).
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if character_coverage is None:
        character_coverage = 0.9995 if byte_fallback else 1.0
    if max_sentences is None:
        max_sentences = DEFAULT_MAX_SENTENCES[model_type]
    sentences = training_sentences(
        documents,
        max_chars=max_training_chars,
        max_sentence_chars=max_sentence_chars,
        max_sentences=max_sentences,
        seed=seed,
    )
    if not sentences:
        raise DataError("no non-empty text to train the tokenizer on")
    settings = {
        "vocab_size": vocab_size,
        "model_type": model_type,
        "byte_fallback": byte_fallback,
        "character_coverage": character_coverage,
        "seed": seed,
        "recipe": _TRAINING_RECIPE_VERSION,
    }
    cached: Path | None = None
    if cache_dir is not None:
        corpus = hashlib.sha256("\n".join(sentences).encode("utf-8")).hexdigest()
        key = stable_key("tokenizer", corpus, settings)
        cached = Path(cache_dir) / f"spm-{model_type}-{vocab_size}-{key[:16]}.model"
        if cached.is_file():
            return load_tokenizer(cached)

    model = io.BytesIO()
    # sentencepiece seeds its (process-global) generator from the OS unless
    # told otherwise; pin it so that nothing in training depends on entropy.
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=byte_fallback,
            character_coverage=character_coverage,
            required_chars=_ASCII_PRINTABLE if byte_fallback else "",
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,  # runs of indentation become single pieces
            split_digits=True,  # numbers as digit sequences: no arbitrary number pieces
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            # Sentences were already sampled and chunked above; these keep
            # sentencepiece from re-sampling or dropping any of them. It refuses
            # a sample size of 100 or fewer, which 0 ("all of them") means too.
            input_sentence_size=len(sentences) if len(sentences) > 100 else 0,
            shuffle_input_sentence=False,
            max_sentence_length=4 * max_sentence_chars,  # bytes; UTF-8 is at most 4 per char
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as error:
        raise _explain_trainer_error(error, vocab_size, byte_fallback, sentences) from error
    tokenizer = Tokenizer(model.getvalue())
    if cached is not None:
        tokenizer.save(cached)
    return tokenizer
=======
>>>>>>> hfinit
