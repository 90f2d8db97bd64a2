"""`load_tokenizer`: a tokenizer of either kind from a file or a directory (data/tokenizer.py says which file wins).

Apart from data/tokenizer.py, which defines the interface both kinds implement, so that no module imports
back the module that imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .hf_tokenizer import HFTokenizer
from .spm_tokenizer import SentencePieceTokenizer
from .tokenizer import TOKENIZER_FILES, Tokenizer, read_special_tokens, tokenizer_file_in


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a `.json` file (Hugging Face), any other file (sentencepiece), or a directory holding
    tokenizer.json or tokenizer.model. Special tokens come from the files beside it (data/tokenizer.py)."""
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
