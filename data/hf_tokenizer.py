"""Hugging Face `tokenizer.json` tokenizers (Llama 3, Qwen, GPT-2, ...) behind the project's Tokenizer interface.

The `tokenizers` library does the work; this wrapper makes it behave like the
sentencepiece one (data/spm_tokenizer.py) where the pipeline relies on it:

- `encode` adds no special tokens; what the post-processor would put before
  the text (Llama 3's `<|begin_of_text|>`) is read once (`post_processor_bos`)
  and decides `family_adds_bos`: packing puts that BOS before each document and
  an EOS after it itself (data/tokenizer.py says what else decides the BOS);
- truncation and padding that a tokenizer.json may carry are switched off, so
  a long document is never silently cut;
- `vocab_size` is one more than the largest id, added tokens included (Llama
  3's 256 reserved special tokens sit above its 128000 pieces);
- pickling sends the JSON text, and the Rust tokenizer is rebuilt lazily in
  each process (`datasets.map(num_proc=...)` workers).

The EOS is not part of tokenizer.json: it comes from the files beside it
(data/tokenizer.py `read_special_tokens`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers

from .cache import atomic_write_bytes
from .tokenizer import HF_TOKENIZER_FILE, NoEosTokenError, SpecialTokens, Tokenizer, no_eos_message


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` held as its JSON text, with the special tokens found beside it."""

    file_name = HF_TOKENIZER_FILE

    def __init__(self, json_text: str, *, path: Path | None = None, special: SpecialTokens = SpecialTokens()):
        self.json_text = json_text
        self.path = path
        self.special = special
        self._tokenizer: tokenizers.Tokenizer | None = None
        self._vocab_size: int | None = None
        self._post_processor_prefix: list[int] | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike, special: SpecialTokens = SpecialTokens()) -> HFTokenizer:
        path = Path(path)
        tokenizer = cls(path.read_text(encoding="utf-8"), path=path, special=special)
        try:
            tokenizer.backend
        except Exception as error:  # the Rust side raises plain Exception for a malformed file
            raise ValueError(f"{str(path)!r} is not a Hugging Face tokenizer.json: {error}") from None
        return tokenizer

    @property
    def backend(self) -> tokenizers.Tokenizer:
        if self._tokenizer is None:
            tokenizer = tokenizers.Tokenizer.from_str(self.json_text)
            tokenizer.no_truncation()
            tokenizer.no_padding()
            self._tokenizer = tokenizer
        return self._tokenizer

    def __getstate__(self) -> dict:
        return {"json_text": self.json_text, "path": self.path, "special": self.special}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["json_text"], path=state["path"], special=state["special"])

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, path={str(self.path)!r})"

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer's JSON and its EOS id (what packing depends on)."""
        try:
            eos = self.eos_id
        except NoEosTokenError:
            eos = None
        bos = f"\nbos={self.bos_id}" if self.adds_bos else ""   # none: the fingerprint of before BOS were added
        return hashlib.sha256(f"{self.backend.to_str()}\neos={eos}{bos}".encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            ids = self.backend.get_vocab(with_added_tokens=True).values()
            self._vocab_size = max(ids, default=-1) + 1
        return self._vocab_size

    def _token_id(self, token: str, what: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.special.source}: {what} {token!r} is not in the vocabulary of {self.path}")
        return token_id

    @property
    def eos_id(self) -> int:
        if self.special.eos_token is not None:
            return self._token_id(self.special.eos_token, "eos_token")
        if self.special.eos_id is not None:
            return self.special.eos_id
        raise NoEosTokenError(no_eos_message(self.path, "tokenizer.json"))

    @property
    def post_processor_bos(self) -> int | None:
        """The id the tokenizer.json's post-processor puts before a text (encoded with special tokens), if it
        puts exactly one there (a TemplateProcessing "<bos> $A"), else None. Read off an encoding, so every
        kind of post-processor (a Sequence holding the template, as Llama 3's) is read the same way."""
        if self._post_processor_prefix is None:
            plain = self.backend.encode("a", add_special_tokens=False).ids
            full = self.backend.encode("a", add_special_tokens=True).ids
            starts = [k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain]
            self._post_processor_prefix = full[:starts[0]] if starts else []
        prefix = self._post_processor_prefix
        return prefix[0] if len(prefix) == 1 else None

    @property
    def family_adds_bos(self) -> bool:
        return self.post_processor_bos is not None

    @property
    def bos_id(self) -> int | None:
        if self.special.bos_token is None:
            return self.post_processor_bos
        return self._token_id(self.special.bos_token, "bos_token")

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(int(token_id))

    def id_of_token(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def encode(self, texts: list[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, no special tokens added. `num_threads` is not used: the library runs
        its own thread pool (TOKENIZERS_PARALLELISM=false turns it off)."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of strings; wrap a single text as [text]")
        return [encoding.ids for encoding in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json (atomically) at `path`; `save_to_directory` also keeps the EOS."""
        path = Path(path)
        atomic_write_bytes(path, self.json_text.encode("utf-8"))
        self.path = path
        return path
