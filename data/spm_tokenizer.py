"""Sentencepiece tokenizers: the picklable `SentencePieceTokenizer` and training one with a cache.

Training settings are chosen for pretraining on mixed prose and code:

- identity normalization, no whitespace collapsing and no dummy prefix, so
  `decode(encode(text)) == text` exactly (indentation survives);
- byte fallback by default, so no text is ever `<unk>`: characters the
  vocabulary lacks (newlines included, see below) become UTF-8 byte pieces;
  printable ASCII is always in the vocabulary, so with byte fallback the
  smallest workable vocabulary is about 360 (256 bytes, 4 special ids, 94
  ASCII characters, plus the corpus's other common characters);
- fixed special ids: pad 0, unk 1, bos 2, eos 3.

Documents are split into lines for training (sentencepiece works on
"sentences"); a newline therefore never appears inside a learned piece and is
encoded as the byte piece `<0x0A>`, one token per line break.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from spillway.layers.errors import DataError

from .cache import atomic_write_bytes, stable_key
from .tokenizer import SPM_TOKENIZER_FILE, NoEosTokenError, SpecialTokens, Tokenizer, no_eos_message


class NoTextError(DataError):
    """The documents given to train a tokenizer hold no text (the caller names where they came from)."""


PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_IDS = (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
MODEL_TYPES = ("bpe", "unigram")
_BPE_MODEL_TYPE = 2   # sentencepiece_model.proto TrainerSpec.ModelType: UNIGRAM = 1, BPE = 2
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


def parse_model_proto(model_proto: bytes):
    """A serialized sentencepiece model as its ModelProto (pieces, normalizer and trainer settings); protobuf's
    DecodeError where the bytes are not one."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    return proto


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model held as its serialized proto.

    Pickling sends only the proto bytes (a few hundred KB), and the C++
    processor is rebuilt lazily on first use in each process, which is what
    `datasets.map(num_proc=...)` workers need. `special` (from the files beside
    a checkpoint's tokenizer.model, data/tokenizer.py) may name another EOS
    than the model's own.
    """

    file_name = SPM_TOKENIZER_FILE

    def __init__(self, model_proto: bytes, *, path: Path | None = None, special: SpecialTokens = SpecialTokens()):
        self.model_proto = bytes(model_proto)
        self.path = path
        self.special = special
        self._processor: spm.SentencePieceProcessor | None = None
        self._unprefixed: spm.SentencePieceProcessor | None = None   # the model without its dummy prefix
        self._parsed = None                # the model proto parsed (`_model`)
        self._scheme: str | None = None   # prefix_scheme, once read
        self._prefix_dropped = False      # (with it) add_prefix_space: false over a model with a dummy prefix
        self._keeps_spaces = True         # (with it) the model's normalizer leaves whitespace as written

    @classmethod
    def from_file(cls, path: str | os.PathLike, special: SpecialTokens = SpecialTokens()) -> SentencePieceTokenizer:
        path = Path(path)
        tokenizer = cls(path.read_bytes(), path=path, special=special)
        if not tokenizer.model_proto:   # parsed as a model of no pieces, refused later as having no EOS
            raise ValueError(f"{str(path)!r} is not a sentencepiece model: the file is empty")
        try:
            tokenizer.processor
        except RuntimeError as error:
            raise ValueError(f"{str(path)!r} is not a sentencepiece model: {error}") from None
        return tokenizer

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        if self._processor is None:
            self._processor = spm.SentencePieceProcessor(model_proto=self.model_proto)
        return self._processor

    def __getstate__(self) -> dict:
        return {"model_proto": self.model_proto, "path": self.path, "special": self.special}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_proto"], path=state["path"], special=state.get("special", SpecialTokens()))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:12]})"

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the model proto (and of the EOS id when a sibling file makes it another than the model's)."""
        digest = hashlib.sha256(self.model_proto)
        if self.special.has_eos and self.eos_id != self.processor.eos_id():
            digest.update(f"eos={self.eos_id}".encode())
        if self.adds_bos:   # none added: the fingerprint of before BOS could be added, so caches stay valid
            digest.update(f"bos={self.bos_id}".encode())
        self._read_prefix_settings()
        if self._prefix_dropped:   # documents encoded without the model's dummy prefix: other tokens
            digest.update(b"add_prefix_space=false")
        return digest.hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def _piece_id(self, piece: str, what: str) -> int:
        piece_id = self.processor.piece_to_id(piece)
        if piece_id == self.processor.unk_id() and piece != self.processor.id_to_piece(piece_id):
            raise ValueError(f"{self.special.source}: {what} {piece!r} is not a piece of the sentencepiece "
                             f"model {self.path}")
        return piece_id

    @property
    def eos_id(self) -> int:
        if self.special.eos_token is not None:
            return self._piece_id(self.special.eos_token, "eos_token")
        if self.special.eos_id is not None:
            return self.special.eos_id
        if self.processor.eos_id() < 0:
            raise NoEosTokenError(no_eos_message(self.path, "sentencepiece model"))
        return self.processor.eos_id()

    @property
    def family_adds_bos(self) -> bool:
        """False: a sentencepiece model says nothing about a BOS before documents; a checkpoint's
        tokenizer_config.json (add_bos_token) or the recipe (data.add_bos) does."""
        return False

    @property
    def bos_id(self) -> int | None:
        if self.special.bos_token is not None:
            return self._piece_id(self.special.bos_token, "bos_token")
        return self.processor.bos_id() if self.processor.bos_id() >= 0 else None

    @property
    def pad_id(self) -> int:
        return self.processor.pad_id()

    @property
    def unk_id(self) -> int:
        return self.processor.unk_id()

    def token_text(self, token_id: int) -> str:
        return self.processor.id_to_piece(int(token_id))

    def id_of_token(self, text: str) -> int | None:
        piece = self.processor.piece_to_id(text)   # the unknown piece's id for a text that is none
        return piece if self.processor.id_to_piece(piece) == text else None

    @property
    def splits_exactly_before_spaces(self) -> bool:
        """True for BPE models like the ones `train_tokenizer` makes: no dummy prefix, whitespace kept as is,
        pieces never crossing a word start (split_by_whitespace). Then " word" encodes alone as it does after
        another word, and a text cut just before such a space encodes to the same ids in pieces.

        Not for a unigram model: its best path over the whole text breaks ties between equal-score paths (a
        run of spaces as 16+16+1 or 1+16+16 pieces) by the float32 rounding of the sum so far, which a cut
        changes (431 of 2.5M ids of Python source cut every few thousand characters differed)."""
        normalizer, trainer = self._model().normalizer_spec, self._model().trainer_spec
        return (trainer.model_type == _BPE_MODEL_TYPE
                and not normalizer.add_dummy_prefix and not normalizer.remove_extra_whitespaces
                and trainer.split_by_whitespace and not trainer.treat_whitespace_as_suffix)

    def encode(self, texts: list[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text (no BOS/EOS added).

        One thread by default: callers parallelise across processes
        (`datasets.map(num_proc=...)`), and threads on top would oversubscribe.
        """
        if isinstance(texts, str):
            raise TypeError("encode takes a list of strings; wrap a single text as [text]")
        return self._document_processor.encode(list(texts), out_type=int, num_threads=num_threads)

    @property
    def prefix_scheme(self) -> str:
        """Where a text cut by special tokens gets the model's dummy prefix ("▁" before the first word, Llama 2's
        and Mistral's models), as transformers' sentencepiece-based tokenizers write it: "always" (before each
        stretch between special tokens: tokenizer_config.json's `legacy: true`), "first" (only a stretch that
        starts the text: transformers' default since `legacy` defaults to false), "never" (`add_prefix_space:
        false`, or a model without a dummy prefix, as those `train_tokenizer` makes)."""
        self._read_prefix_settings()
        return self._scheme

    def _read_prefix_settings(self) -> None:
        """`prefix_scheme` and the two facts beside it, read once from the model's proto and the config."""
        if self._scheme is None:
            normalizer = self._model().normalizer_spec
            self._prefix_dropped = bool(normalizer.add_dummy_prefix and self.special.add_prefix_space is False)
            self._keeps_spaces = not normalizer.remove_extra_whitespaces
            if self.special.add_prefix_space is False or not normalizer.add_dummy_prefix:
                self._scheme = "never"
            else:
                self._scheme = "always" if self.special.legacy else "first"

    @property
    def _document_processor(self) -> spm.SentencePieceProcessor:
        """What encodes a document: the model, less its dummy prefix where tokenizer_config.json says
        `add_prefix_space: false` (transformers writes none then)."""
        self._read_prefix_settings()
        return self._processor_without_prefix if self._prefix_dropped else self.processor

    def special_piece_ids(self) -> dict[str, int]:
        """The special tokens tokenizer_config.json names beyond BOS/EOS (Gemma's <end_of_turn>) that are pieces
        of this model, with their ids: matched in a chat template's text as transformers matches them."""
        ids = {text: self.processor.piece_to_id(text) for text in self.special.other_specials}
        return {text: piece for text, piece in ids.items() if self.processor.id_to_piece(piece) == text}

    def special_whitespace(self) -> dict[str, tuple[bool, bool]]:
        """{special token text: (lstrip, rstrip)} for the special tokens that absorb the whitespace beside them in
        transformers (tokenizer_config.json's added_tokens_decoder)."""
        return {text: (left, right) for text, left, right in self.special.stripping}

    @property
    def chat_encoding(self) -> str:
        """The stretches between special tokens encoded whole, with the dummy prefix where `prefix_scheme` puts
        it (rows made before were cut at the answers' edges too: a model with a dummy prefix had one before
        every answer, one without may have split a piece there)."""
        return (f"stretches-whole, prefix {self.prefix_scheme}, specials {sorted(self.special_piece_ids())}, "
                f"stripping {sorted(self.special.stripping)}")

    @property
    def _processor_without_prefix(self) -> spm.SentencePieceProcessor:
        if self._unprefixed is None:
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.CopyFrom(self._model())   # a copy: the parsed model stays as the file says
            proto.normalizer_spec.add_dummy_prefix = False
            self._unprefixed = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        return self._unprefixed

    def _model(self):
        """The model proto parsed (its normalizer's and trainer's settings), once."""
        if self._parsed is None:
            self._parsed = parse_model_proto(self.model_proto)
        return self._parsed

    def encode_with_offsets(self, text: str, *, starts_the_text: bool = True
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (no BOS/EOS added) and each token's (start, end) character offsets in it: where
        it came from, so that a chat example's answer is found among the ids of its text encoded whole.
        `starts_the_text`: false for a stretch after a special token, which gets the dummy prefix as
        `prefix_scheme` says. A dummy prefix has no characters: (0, 0)."""
        scheme = self.prefix_scheme
        prefixed = scheme == "always" or (scheme == "first" and starts_the_text)
        # transformers' Metaspace writes no "▁" before a text that starts with one (a "▁", or a space, once
        # spaces are "▁"); sentencepiece's dummy prefix would make it two
        if self._keeps_spaces and text.startswith((" ", "\u2581")):
            prefixed = False
        processor = self.processor if prefixed else self._processor_without_prefix
        pieces = processor.encode(text, return_type="proto").pieces
        ids = [piece.id for piece in pieces]
        offsets = [(piece.begin, piece.end) for piece in pieces]   # bytes of the UTF-8 input
        if text.isascii():   # a byte a character
            return ids, offsets
        char_at = [index for index, char in enumerate(text) for _ in range(len(char.encode("utf-8")))]
        char_at.append(len(text))
        last = len(char_at) - 1
        return ids, [(char_at[min(begin, last)], char_at[min(end, last)]) for begin, end in offsets]

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode([int(i) for i in ids])

    def save(self, path: str | os.PathLike) -> Path:
        """Write the `.model` file (atomically) and return its path."""
        path = Path(path)
        atomic_write_bytes(path, self.model_proto)
        self.path = path
        return path


def load_spm_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """A sentencepiece `.model` file on its own (ours or anyone's), with its own special ids."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer model {str(path)!r} does not exist")
    return SentencePieceTokenizer.from_file(path)


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


def _check_room_for_the_fixed_pieces(vocab_size: int, byte_fallback: bool) -> None:
    """DataError, before the corpus is read, for a vocabulary smaller than the pieces every trained tokenizer
    holds: sentencepiece stopped on vocab_size 1-3 with "INTERNAL: ... insert_id(...)"; between that and the
    corpus's own count, its trainer names the count (`_explain_trainer_error`)."""
    fixed = len(SPECIAL_IDS) + (256 + len(_ASCII_PRINTABLE) if byte_fallback else 1)
    if vocab_size < fixed:
        what = (f"{len(SPECIAL_IDS)} special ids, 256 byte pieces for byte_fallback and one per printable ASCII "
                f"character" if byte_fallback else f"{len(SPECIAL_IDS)} special ids and a character")
        raise DataError(f"vocab_size={vocab_size} is too small to train a tokenizer: its {what} need at least "
                        f"{fixed} pieces, and the corpus's other characters more; raise vocab_size, or use a trained "
                        f"tokenizer (a recipe's data.tokenizer)")


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
) -> SentencePieceTokenizer:
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
    _check_room_for_the_fixed_pieces(vocab_size, byte_fallback)
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
        raise NoTextError("no non-empty text to train the tokenizer on")
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
            return load_spm_tokenizer(cached)

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
    tokenizer = SentencePieceTokenizer(model.getvalue())
    if cached is not None:
        tokenizer.save(cached)
    return tokenizer
